//! Every problem the API accepts plans, on every kind of device, to kernels that device can
//! run: each head dim the CUDA path takes (multiples of 8 up to 256), with and without a causal
//! mask, softcap/ALiBi, block mask, packed batches and dropout, forward, backward and decode.
//! "Can run": compiled for the device's set (the wgmma and warp-specialized kernels on Hopper
//! only), its shared memory within the device's, compiled for the head dim or a larger one,
//! and compiled with the code the problem needs (dropout, modifiers, packed sequences). The
//! planners' own tests say which kernel is chosen; these say that no choice is impossible, so
//! that a new catalogue row or planner rule cannot leave, say, an RTX 4090 (99 KB) without a
//! backward at some head dim.

use super::super::catalogue::{Family, Kernel, Mods};
use super::super::runtime::DeviceFacts;
use super::test_facts::{A100, ADA, HOPPER};
use super::*;

const DEVICES: [(&str, DeviceFacts); 3] = [("Hopper", HOPPER), ("A100", A100), ("Ada", ADA)];

/// The head dims the CUDA path accepts.
fn head_dims() -> impl Iterator<Item = usize> {
    (8..=256).step_by(8)
}

/// What a problem asks of its kernels' compiled code.
#[derive(Clone, Copy, Debug)]
struct Needs {
    d: usize,
    mods: Mods,
    /// A softcap without ALiBi (the `_cap` kernels' problems).
    cap_alone: bool,
    packed: bool,
    dropout: bool,
}

fn needs_grid() -> impl Iterator<Item = Needs> {
    head_dims().flat_map(|d| {
        let mut grid = vec![];
        for (mods, cap_alone) in [
            (Mods::None, false),
            (Mods::Scores, false),
            (Mods::Scores, true),
            (Mods::Sparse, false),
        ] {
            for packed in [false, true] {
                for dropout in [false, true] {
                    grid.push(Needs {
                        d,
                        mods,
                        cap_alone,
                        packed,
                        dropout,
                    });
                }
            }
        }
        grid
    })
}

/// Whether code compiled with `have` serves a problem at `need`: each level includes the one
/// below (None < Scores < Sparse < Any); `Cap` only a softcap without ALiBi.
fn mods_cover(have: Mods, need: Mods, cap_alone: bool) -> bool {
    let rank = |m: Mods| match m {
        Mods::None => 0,
        Mods::Cap => 1,
        Mods::Scores => 2,
        Mods::Sparse => 3,
        Mods::Any => 4,
    };
    match have {
        Mods::Cap => need == Mods::None || (need == Mods::Scores && cap_alone),
        _ => rank(have) >= rank(need),
    }
}

/// Why `k` cannot run `n` on `dev`, if it cannot. Helpers without a head dim (0) or
/// problem-dependent code (dsum, converts, prep) are checked for the device alone.
fn unfit(k: Kernel, n: &Needs, dev: &DeviceFacts) -> Option<String> {
    let v = k.variant();
    let g = k.geometry();
    // build.rs's rule: the files under cuda/sm90 are compiled for sm_90a only.
    if v.family.file().path().starts_with("sm90/") && !dev.hopper() {
        return Some("a Hopper kernel".into());
    }
    if g.smem as usize > dev.smem {
        return Some(format!(
            "{} B of shared memory, the device allows {}",
            g.smem, dev.smem
        ));
    }
    if v.d != 0 && usize::from(v.d) < n.d {
        return Some(format!("compiled for head dim {}", v.d));
    }
    let main = matches!(
        v.family,
        Family::Fwd
            | Family::FwdSm90
            | Family::FwdWs
            | Family::BwdDkdv
            | Family::BwdDq
            | Family::BwdFused
            | Family::BwdSm90
            | Family::BwdWs
    );
    if !main {
        return None;
    }
    if !mods_cover(v.mods, n.mods, n.cap_alone) {
        return Some(format!(
            "compiled with {:?} for a {:?} problem",
            v.mods, n.mods
        ));
    }
    // Dropout: the separate dK/dV and dQ kernels always keep its code; the wgmma kernels
    // have none; the others have it where their row says so. The warp-specialized kernels are compiled per
    // combination, so a kernel without dropout or packed batches serves none.
    let has_dropout = match v.family {
        Family::BwdDkdv | Family::BwdDq => true,
        Family::FwdSm90 | Family::BwdSm90 => false,
        _ => v.dropout,
    };
    if n.dropout && !has_dropout {
        return Some("no dropout code".into());
    }
    if matches!(v.family, Family::FwdWs | Family::BwdWs)
        && (v.packed != n.packed || v.dropout != n.dropout)
    {
        return Some(format!(
            "warp-specialized with packed={} dropout={}",
            v.packed, v.dropout
        ));
    }
    None
}

fn check(what: &str, kernels: &[Kernel], n: &Needs, name: &str, dev: &DeviceFacts) {
    for &k in kernels {
        if let Some(why) = unfit(k, n, dev) {
            panic!("{name}: {what} for {n:?} chose {:?}: {why}", k.variant());
        }
    }
}

#[test]
fn every_forward_problem_has_a_kernel_the_device_runs() {
    for (name, dev) in DEVICES {
        for n in needs_grid() {
            for causal in [false, true] {
                for (sq, sk) in [(1, 1), (113, 1023), (512, 512), (16384, 16384)] {
                    let q = FwdQuery {
                        d: n.d,
                        sq,
                        sk,
                        causal,
                        mods: n.mods,
                        packed: n.packed,
                        dropout: n.dropout,
                        pairs: 64,
                    };
                    let plan = plan_fwd(&q, &dev)
                        .unwrap_or_else(|e| panic!("{name}: forward of {q:?}: {e}"));
                    let mut kernels = vec![plan.fallback];
                    kernels.extend(plan.ws);
                    check("the forward", &kernels, &n, name, &dev);
                }
            }
        }
    }
}

#[test]
fn every_backward_problem_has_kernels_the_device_runs() {
    for (name, dev) in DEVICES {
        for n in needs_grid() {
            for deterministic in [false, true] {
                let q = BwdQuery {
                    d: n.d,
                    deterministic,
                    dropout: n.dropout,
                    mods: n.mods,
                    cap_alone: n.cap_alone,
                    packed: n.packed,
                };
                let (ws, plan) =
                    plan_bwd(&q, &dev).unwrap_or_else(|e| panic!("{name}: backward of {q:?}: {e}"));
                for plan in ws.into_iter().chain([plan]) {
                    let kernels = match plan {
                        BwdPlan::Separate { dkdv, dq } => vec![dkdv, dq],
                        BwdPlan::Fused { dkdvq, convert } | BwdPlan::Sm90 { dkdvq, convert } => {
                            vec![dkdvq, convert]
                        }
                        BwdPlan::Ws {
                            prep,
                            main,
                            convert,
                        } => vec![prep, main, convert],
                    };
                    check("the backward", &kernels, &n, name, &dev);
                    if deterministic {
                        let ok = match plan {
                            BwdPlan::Separate { .. } => true,
                            BwdPlan::Ws { .. } => true,
                            BwdPlan::Fused { .. } | BwdPlan::Sm90 { .. } => false,
                        };
                        assert!(ok, "{name}: deterministic {q:?} planned {plan:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn every_decode_problem_has_a_kernel_the_device_runs() {
    for (name, dev) in DEVICES {
        // Blocks a multiprocessor holds, as the driver would say by shared memory and
        // threads alone; clusters only on Hopper.
        let residency = |k: Kernel| {
            let g = k.geometry();
            Ok((dev.smem / (g.smem as usize).max(1)).min(2048 / g.threads as usize))
        };
        let clusters = |_: Kernel, size: usize| Ok(if dev.hopper() { dev.sms / size } else { 0 });
        for d in head_dims() {
            for fp8_cache in [false, true] {
                for (rows, pairs, max_len) in
                    [(1, 1, 1), (4, 8, 768), (16, 64, 8192), (64, 1, 65536)]
                {
                    let q = DecodeQuery {
                        d,
                        rows,
                        pairs,
                        max_len,
                        fp8_cache,
                    };
                    let plan = match plan_decode(&q, dev.sms, dev.smem, residency, clusters) {
                        Ok(plan) => plan,
                        // e4m3 caches have kernels at some head dims only, and say so.
                        Err(e) if fp8_cache && e.to_string().contains("use a bf16/f16 cache") => {
                            continue
                        }
                        Err(e) => panic!("{name}: decode of {q:?}: {e}"),
                    };
                    let v = plan.kernel.variant();
                    let g = plan.kernel.geometry();
                    assert!(
                        g.smem as usize <= dev.smem && usize::from(v.d) >= d && v.fp8 == fp8_cache,
                        "{name}: decode of {q:?} chose {v:?} ({} B of shared memory)",
                        g.smem
                    );
                    assert!(
                        (1..=128).contains(&plan.splits),
                        "{name}: {q:?}: {} splits",
                        plan.splits
                    );
                    assert!(
                        !plan.cluster || dev.hopper(),
                        "{name}: a cluster merge off Hopper"
                    );
                }
            }
        }
    }
}
