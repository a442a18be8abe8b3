//! Kernel images of `cuda/*.cu`, compiled by build.rs and embedded: one set for Hopper
//! (`sm90a`: the wgmma kernels and the files with sm_90-only code paths) and one for every GPU
//! from Ampere on (`sm80`). A constant is `None` where build.rs did not build that file for
//! that set; Hopper takes the files its set lacks from `sm80`.
include!(concat!(env!("OUT_DIR"), "/ptx.rs"));

/// One file's compiled kernels: PTX text (JIT-compiled by the driver at load) or a fatbin
/// (machine code for the targeted GPUs, and for the sm80 set its PTX too).
#[derive(Clone, Copy, Debug)]
// Which variants a build constructs depends on its targets.
#[allow(dead_code)]
pub enum Image {
    Ptx(&'static str),
    Fatbin(&'static [u8]),
}
