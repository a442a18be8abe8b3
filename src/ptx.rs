//! PTX of `cuda/*.cu`, compiled by build.rs and embedded as string constants.
include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
