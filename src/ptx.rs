//! Kernel images of `cuda/*.cu`, compiled by build.rs and embedded: one set for Hopper
//! (`sm90a`: the wgmma kernels and the files with sm_90-only code paths) and one for every GPU
//! from Ampere on (`sm80`). A constant is `None` where build.rs did not build that file for
//! that set; Hopper takes the files its set lacks from `sm80`.
include!(concat!(env!("OUT_DIR"), "/ptx.rs"));

/// One file's compiled kernels, a fatbin: machine code for the GPUs the build targeted, and
/// the sm80 set's PTX (or with no target, both sets' PTX), which the driver JIT-compiles for
/// the others.
#[derive(Clone, Copy, Debug)]
pub struct Image(pub &'static [u8]);

/// One file's images: a single one, or one per dtype for the files build.rs compiles a dtype
/// at a time (their kernel names carry the dtype).
#[derive(Clone, Copy, Debug)]
#[allow(dead_code)] // which variants a build constructs depends on its targets
pub enum Parts {
    One(Option<Image>),
    ByDtype(Option<Image>, Option<Image>),
}

impl Parts {
    /// The image holding `kernel`, and a name for it within the file.
    pub fn for_kernel(self, kernel: &str) -> (Option<Image>, &'static str) {
        match self {
            Parts::One(image) => (image, "all"),
            Parts::ByDtype(_, bf16) if kernel.contains("_bf16") => (bf16, "bf16"),
            Parts::ByDtype(f16, _) => (f16, "f16"),
        }
    }
}
