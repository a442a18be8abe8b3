//! The training kernels on the host: the catalogue of `cuda/train/catalogue.rs` (every kernel
//! of `cuda/train/train.cu` as an op and its element types) with the entry point names build.rs
//! generated from it. The launchers find a kernel by op and their operands' dtypes; nothing
//! else names one.

use candle::{bail, DType, Result};

#[allow(dead_code)] // the table's doc-only items
#[path = "../../cuda/train/catalogue.rs"]
mod table;
pub(crate) use table::Op;
use table::{Dtypes, Elem};

/// A compiled training kernel: what it computes, for which element types, and its entry
/// point.
pub(crate) struct TrainKernel {
    op: Op,
    dtypes: Dtypes,
    name: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/train_catalogue.rs"));

impl TrainKernel {
    /// The entry point of `op` for `dtypes` (`None`: not compiled).
    fn find(op: Op, dtypes: Dtypes) -> Option<&'static str> {
        TRAIN_KERNELS
            .iter()
            .find(|k| k.op == op && k.dtypes == dtypes)
            .map(|k| k.name)
    }

    /// The entry point of `op` for its operands' dtypes, each given with what it is for the
    /// error (`("rms_norm: x", dtype)`), in the kernel's order. An unsupported dtype is an
    /// error naming its operand and the dtypes compiled (for those before it).
    pub(crate) fn name(op: Op, args: &[(&str, DType)]) -> Result<&'static str> {
        let mut elems: Vec<Elem> = Vec::with_capacity(args.len());
        for (i, &(what, dtype)) in args.iter().enumerate() {
            // The element types compiled at position i after those chosen, in table order.
            let mut compiled: Vec<Elem> = vec![];
            for k in TRAIN_KERNELS.iter().filter(|k| k.op == op) {
                let ks = k.dtypes.elems();
                if ks.len() == args.len() && ks[..i] == elems[..] && !compiled.contains(&ks[i]) {
                    compiled.push(ks[i]);
                }
            }
            match elem(dtype).filter(|e| compiled.contains(e)) {
                Some(e) => elems.push(e),
                None => {
                    let after = match i {
                        0 => String::new(),
                        _ => format!(" with {:?} for {}", args[i - 1].1, args[i - 1].0),
                    };
                    bail!(
                        "{what}: dtype {dtype:?} is not supported{after}, expected {}",
                        one_of(&compiled)
                    )
                }
            }
        }
        let dtypes = match elems[..] {
            [] => Dtypes::Untyped,
            [a] => Dtypes::One(a),
            [a, b] => Dtypes::Two(a, b),
            _ => bail!("train: no {op:?} kernel takes {} dtypes", elems.len()),
        };
        match TrainKernel::find(op, dtypes) {
            Some(name) => Ok(name),
            None => bail!("train: no {op:?} kernel for {dtypes:?}"),
        }
    }
}

fn elem(dtype: DType) -> Option<Elem> {
    match dtype {
        DType::BF16 => Some(Elem::BF16),
        DType::F16 => Some(Elem::F16),
        DType::F32 => Some(Elem::F32),
        _ => None,
    }
}

/// `BF16, F16 or F32`.
fn one_of(elems: &[Elem]) -> String {
    let names: Vec<String> = elems.iter().map(|e| format!("{e:?}")).collect();
    match names.split_last() {
        None => "none".into(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_catalogue_kernel_has_its_name() {
        let n: usize = table::TRAIN_CATALOGUE
            .iter()
            .map(|(_, all)| all.len())
            .sum();
        assert_eq!(TRAIN_KERNELS.len(), n);
        for &(op, all) in table::TRAIN_CATALOGUE {
            for &dtypes in all {
                let name = TrainKernel::find(op, dtypes).unwrap();
                assert!(name.starts_with("train_"), "{name}");
            }
        }
        let norm = [
            ("rms_norm: x", DType::BF16),
            ("rms_norm: weight", DType::F32),
        ];
        assert_eq!(
            TrainKernel::name(Op::RmsFwd, &norm).unwrap(),
            "train_rms_fwd_bf16_f32"
        );
        assert_eq!(
            TrainKernel::name(Op::AdamwApply, &[]).unwrap(),
            "train_adamw_apply"
        );
        let e = TrainKernel::name(Op::Rotary, &[("rotary: x", DType::F64)]).unwrap_err();
        assert!(
            e.to_string()
                .contains("rotary: x: dtype F64 is not supported, expected BF16, F16 or F32"),
            "{e}"
        );
        let mixed = [
            ("rms_norm: x", DType::BF16),
            ("rms_norm: weight", DType::F16),
        ];
        let e = TrainKernel::name(Op::RmsBwd, &mixed)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rms_norm: weight: dtype F16") && e.contains("expected F32 or BF16"),
            "{e}"
        );
    }
}
