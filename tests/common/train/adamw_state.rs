//! `train::AdamW`'s state and failures: a state is a copy that later updates leave alone, an
//! update that fails (a bad gradient of any but the first variable, a setting out of range)
//! changes nothing and its retry equals one clean update, and every malformed state given to
//! `load_state` is an error naming the entry, leaving the optimiser as it was.

use std::collections::{BTreeMap, HashMap};

use candle::backprop::GradStore;
use candle::{DType, Device, Result, Tensor, Var};
use candle_flash::train::AdamW;

use super::Report;
use crate::common::randn;

const SHAPES: [&[usize]; 3] = [&[7], &[13, 5], &[1]];

/// Everything an update may change, as bits: the variables' values and the whole state.
#[derive(PartialEq, Debug)]
struct Bits {
    vars: Vec<Vec<u32>>,
    state: BTreeMap<String, Vec<u32>>,
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    let t = t.flatten_all()?.to_device(&Device::Cpu)?;
    match t.dtype() {
        DType::U32 => t.to_vec1::<u32>(),
        _ => Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect()),
    }
}

fn state_bits(state: &HashMap<String, Tensor>) -> Result<BTreeMap<String, Vec<u32>>> {
    state
        .iter()
        .map(|(k, t)| Ok((k.clone(), bits(t)?)))
        .collect()
}

fn all_bits(opt: &AdamW) -> Result<Bits> {
    Ok(Bits {
        vars: opt
            .vars()
            .iter()
            .map(|(_, v)| bits(v.as_tensor()))
            .collect::<Result<_>>()?,
        state: state_bits(&opt.state()?)?,
    })
}

/// An optimiser over fresh variables holding `inits` on `dev`.
fn optimiser(dev: &Device, inits: &[Tensor]) -> Result<AdamW> {
    let vars = inits
        .iter()
        .enumerate()
        .map(|(i, t)| Ok((format!("w{i}"), Var::from_tensor(&t.to_device(dev)?)?)))
        .collect::<Result<Vec<_>>>()?;
    AdamW::new(vars, 1e-2, 0.1)
}

/// Gradients `gs` (one per variable of `opt`, `None` for none) in a `GradStore`.
fn grad_store(opt: &AdamW, gs: &[Option<Tensor>]) -> Result<GradStore> {
    let mut store = Tensor::zeros((), DType::F32, &Device::Cpu)?.backward()?;
    for ((_, v), g) in opt.vars().iter().zip(gs) {
        if let Some(g) = g {
            store.insert(v.as_tensor(), g.clone());
        }
    }
    Ok(store)
}

/// One random gradient of `dtype` per variable of [`SHAPES`], on `dev`.
fn gradients(dtype: DType, dev: &Device) -> Result<Vec<Option<Tensor>>> {
    SHAPES
        .iter()
        .map(|s| Ok(Some(randn(*s, dtype)?.to_device(dev)?)))
        .collect()
}

/// Two optimisers with equal variables after one equal update (moments and step not zero).
fn twins(dev: &Device) -> Result<(AdamW, AdamW)> {
    let inits = SHAPES
        .iter()
        .map(|s| randn(*s, DType::F32))
        .collect::<Result<Vec<_>>>()?;
    let (mut a, mut b) = (optimiser(dev, &inits)?, optimiser(dev, &inits)?);
    let g = gradients(DType::BF16, dev)?;
    a.update(&grad_store(&a, &g)?, 0.5)?;
    b.update(&grad_store(&b, &g)?, 0.5)?;
    Ok((a, b))
}

/// A state taken before an update (and one restored from) keeps its values.
pub fn snapshot(dev: &Device, report: Report) {
    let r = (|| {
        let (mut opt, mut other) = twins(dev)?;
        let state = opt.state()?;
        let before = state_bits(&state)?;
        let g = gradients(DType::F32, dev)?;
        opt.update(&grad_store(&opt, &g)?, 1.0)?;
        if state_bits(&state)? != before {
            candle::bail!("an update changed a state taken before it")
        }
        other.load_state(&state)?;
        other.update(&grad_store(&other, &g)?, 1.0)?;
        if state_bits(&state)? != before {
            candle::bail!("an update after load_state changed the state loaded")
        }
        if all_bits(&other)? != all_bits(&opt)? {
            candle::bail!("restoring a state and updating differs from updating")
        }
        Ok(())
    })();
    report("AdamW state is a copy".into(), r);
}

/// An update failing on the second variable's gradient, or on a setting, leaves everything
/// as it was, and the retry with good gradients equals one clean update.
pub fn all_or_nothing(dev: &Device, report: Report) {
    type Bad = (&'static str, fn(&Device) -> Result<Tensor>, &'static str);
    let bad: [Bad; 4] = [
        ("shape", |d| randn(7, DType::F32)?.to_device(d), "shape"),
        ("dtype", |d| randn((13, 5), DType::F64)?.to_device(d), "F64"),
        ("int", |d| Tensor::zeros((13, 5), DType::U32, d), "U32"),
        ("device", |_| randn((13, 5), DType::F32), "Cpu"),
    ];
    for (what, make, expected) in bad {
        if what == "device" && dev.is_cpu() {
            continue; // a gradient on the CPU is right there
        }
        let name = format!("AdamW all or nothing: bad {what} of the second gradient");
        let fail = |opt: &mut AdamW| {
            let mut g = gradients(DType::F32, dev)?;
            g[1] = Some(make(dev)?);
            opt.update(&grad_store(opt, &g)?, 1.0)
        };
        report(name, retry_after(dev, fail, &["w1", expected]));
    }
    type Setting = (&'static str, fn(&mut AdamW), f64, &'static str);
    let settings: [Setting; 5] = [
        ("grad_scale NaN", |_| {}, f64::NAN, "grad_scale"),
        ("lr inf", |o| o.lr = f64::INFINITY, 1.0, "lr"),
        ("beta1 1", |o| o.beta1 = 1.0, 1.0, "beta1"),
        ("eps -1", |o| o.eps = -1.0, 1.0, "eps"),
        ("step i32::MAX", |o| o.step = i32::MAX as usize, 1.0, "step"),
    ];
    for (what, set, scale, expected) in settings {
        let name = format!("AdamW all or nothing: {what}");
        let fail = |opt: &mut AdamW| {
            let saved = (opt.lr, opt.beta1, opt.eps, opt.step);
            set(opt);
            let r = opt.update(&grad_store(opt, &gradients(DType::F32, dev)?)?, scale);
            // The settings are the caller's: put them back before comparing.
            (opt.lr, opt.beta1, opt.eps, opt.step) = saved;
            r
        };
        report(name, retry_after(dev, fail, &[expected]));
    }
}

/// Runs `fail` on one of two equal optimisers, which must fail with a message holding each
/// of `expected` and change nothing; then one good update of both must give equal bits.
fn retry_after(
    dev: &Device,
    fail: impl Fn(&mut AdamW) -> Result<()>,
    expected: &[&str],
) -> Result<()> {
    let (mut a, mut b) = twins(dev)?;
    let before = all_bits(&a)?;
    match fail(&mut a) {
        Ok(()) => candle::bail!("the update succeeded"),
        Err(e) => {
            let msg = e.to_string();
            if let Some(part) = expected.iter().find(|p| !msg.contains(*p)) {
                candle::bail!("error {msg:?} does not name {part:?}")
            }
        }
    }
    if all_bits(&a)? != before {
        candle::bail!("the failed update changed the variables, the moments or the step")
    }
    let g = gradients(DType::F16, dev)?;
    a.update(&grad_store(&a, &g)?, 0.7)?;
    b.update(&grad_store(&b, &g)?, 0.7)?;
    if all_bits(&a)? != all_bits(&b)? {
        candle::bail!("the retry differs from one clean update")
    }
    Ok(())
}

/// Each malformed state is refused with an error naming the entry and leaves the optimiser
/// as it was; the forms a checkpoint may take (a scalar step, F32 or I64 steps, moments
/// on the CPU) load.
pub fn malformed(dev: &Device, report: Report) {
    let r = (|| {
        let (mut opt, _) = twins(dev)?;
        let good = opt.state()?;
        let before = all_bits(&opt)?;
        let with = |key: &str, t: Option<Tensor>| {
            let mut s = good.clone();
            match t {
                Some(t) => s.insert(key.to_string(), t),
                None => s.remove(key),
            };
            s
        };
        let bad_steps = [
            (Tensor::zeros(0, DType::U32, &Device::Cpu)?, "shape [0]"),
            (Tensor::new(&[1u32, 2], dev)?, "shape [2]"),
            (Tensor::new(&[[1u32]], dev)?, "shape [1, 1]"),
            (Tensor::new(&[1f32], dev)?.to_dtype(DType::F16)?, "F16"),
            (Tensor::new(&[f32::NAN], dev)?, "NaN"),
            (Tensor::new(&[f32::INFINITY], dev)?, "inf"),
            (Tensor::new(&[2.5f32], dev)?, "2.5"),
            (Tensor::new(&[-1f64], dev)?, "-1"),
            (Tensor::new(&[-3i64], dev)?, "-3"),
            (Tensor::new(&[u32::MAX], dev)?, "4294967295"),
        ];
        let mut cases: Vec<(&str, Option<Tensor>, &str)> = bad_steps
            .into_iter()
            .map(|(t, e)| ("step", Some(t), e))
            .collect();
        cases.extend([
            ("step", None, "missing"),
            ("m.w1", None, "missing"),
            ("v.w0", None, "missing"),
            ("m.w1", Some(good["m.w1"].flatten_all()?), "[65]"),
            ("v.w2", Some(good["v.w2"].to_dtype(DType::F64)?), "F64"),
            ("m.w0", Some(good["m.w0"].to_dtype(DType::BF16)?), "BF16"),
            ("m.w9", Some(good["m.w0"].clone()), "unexpected"),
            ("lr", Some(good["step"].clone()), "unexpected"),
        ]);
        for (key, t, expected) in cases {
            let case = format!("{key} {t:?}");
            match opt.load_state(&with(key, t)) {
                Ok(()) => candle::bail!("{case} loaded"),
                Err(e) => {
                    let msg = e.to_string();
                    if !msg.contains(key) || !msg.contains(expected) {
                        candle::bail!("{case}: error {msg:?} does not name {key} and {expected}")
                    }
                }
            }
            if all_bits(&opt)? != before {
                candle::bail!("{case}: a refused state changed the optimiser")
            }
        }
        for (t, want) in [
            (Tensor::new(3u32, dev)?, 3),
            (Tensor::new(&[4f32], dev)?, 4),
            (Tensor::new(&[5i64], &Device::Cpu)?, 5),
            (Tensor::new(&[6i32], &Device::Cpu)?, 6),
            (Tensor::new(&[7i16], &Device::Cpu)?, 7),
            (Tensor::new(&[8u8], &Device::Cpu)?, 8),
            (Tensor::new(&[9f64], dev)?, 9),
        ] {
            opt.load_state(&with("step", Some(t)))?;
            if opt.step != want {
                candle::bail!("step {} loaded, expected {want}", opt.step)
            }
        }
        let on_cpu = good
            .iter()
            .map(|(k, t)| Ok((k.clone(), t.to_device(&Device::Cpu)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        opt.load_state(&on_cpu)?;
        if all_bits(&opt)? != before {
            candle::bail!("a state on the CPU did not load as it was")
        }
        if !dev.is_cpu() {
            // Variables on the CPU, a state on the device: neither theirs nor the CPU.
            let (mut cpu_opt, _) = twins(&Device::Cpu)?;
            match cpu_opt.load_state(&good) {
                Ok(()) => candle::bail!("a state on {:?} loaded onto the CPU", dev.location()),
                Err(e) if !e.to_string().contains("Cuda") => {
                    candle::bail!("error {e} does not name the device")
                }
                Err(_) => {}
            }
        }
        Ok(())
    })();
    report("AdamW load_state refuses malformed states".into(), r);
}
