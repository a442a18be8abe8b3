//! The CUDA runtime the launchers share: what a device is (compute capability, SMs, shared
//! memory), the kernels' modules and functions loaded once per device, launches (plain and
//! programmatic), per-stream counters and the NaN poisoning of outputs for tests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle::cuda_backend::cudarc::driver::result::memset_d8_async;
use candle::cuda_backend::cudarc::driver::sys::{self, CUdevice_attribute, CUfunction_attribute};
use candle::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use candle::cuda_backend::cudarc::nvrtc::Ptx;
use candle::cuda_backend::WrapErr;
use candle::{bail, DType, Result};

use super::catalogue::{File, Kernel};
use super::overrides;
use crate::ptx;

/// Where a stream's work is ordered: `(device ordinal, stream handle, host thread)`. Candle's
/// devices run on the per-thread default stream, whose one handle (0x2) names a different
/// stream in every host thread, and cudarc does no cross-stream tracking for it: work of two
/// threads runs concurrently, unordered. Device buffers that kernels write (counters), or
/// that a launch may read before an upload lands (shared uploads), are therefore kept per
/// key, and freed only by the thread whose stream they belong to.
pub(crate) type StreamKey = (usize, usize, Option<std::thread::ThreadId>);

/// The [`StreamKey`] of `stream` for the calling thread.
pub(crate) fn stream_key(stream: &CudaStream) -> StreamKey {
    // CU_STREAM_PER_THREAD (cuda.h); the legacy default stream (0x1, or null) is one stream
    // for every thread.
    const PER_THREAD: usize = 0x2;
    let handle = stream.cu_stream() as usize;
    let thread = (handle == PER_THREAD).then(|| std::thread::current().id());
    (stream.context().ordinal(), handle, thread)
}

/// What the launchers ask of a device once: compute capability, SM count and the shared
/// memory a block may opt into.
#[derive(Clone, Copy)]
pub(crate) struct DeviceFacts {
    pub major: i32,
    pub sms: usize,
    /// Bytes of dynamic shared memory one block may use (A100 163 KB, sm_86/89 99 KB, Hopper
    /// 227 KB); `CANDLE_FLASH_SMEM_KB` lowers it, to run another GPU's tile choices.
    pub smem: usize,
}

impl DeviceFacts {
    /// Compute capability 9.x: the wgmma kernels, and programmatic launch, are built for
    /// sm_90a only. False on Hopper too when `CANDLE_FLASH_ARCH=sm80` asks for the sm_80 set.
    pub fn hopper(&self) -> bool {
        self.major == 9
    }
}

/// [`DeviceFacts`] of `dev`, cached per device ordinal. Errors for GPUs older than Ampere,
/// which have no `cp.async` or bf16 tensor cores.
pub(crate) fn device_facts(dev: &candle::CudaDevice) -> Result<DeviceFacts> {
    static KNOWN: Mutex<Vec<(usize, DeviceFacts)>> = Mutex::new(Vec::new());
    let ordinal = dev.cuda_stream().context().ordinal();
    let mut known = KNOWN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(&(_, facts)) = known.iter().find(|(o, _)| *o == ordinal) {
        return Ok(facts);
    }
    let context = dev.cuda_stream().context().clone();
    let attr = |a| context.attribute(a).w();
    let major = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    if major < 8 {
        bail!(
            "candle-flash: CUDA device {ordinal} has compute capability {major}.{minor}; the \
             CUDA kernels need 8.0 or newer (Ampere, Ada, Hopper). The CPU implementation runs \
             anywhere."
        )
    }
    let forced = overrides::overrides();
    let smem_cap = forced
        .smem_kb
        .map_or(usize::MAX, |kb| kb.saturating_mul(1024));
    let facts = DeviceFacts {
        major: if forced.arch_sm80 { 8 } else { major },
        sms: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize,
        smem: (attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            as usize)
            .min(smem_cap),
    };
    known.push((ordinal, facts));
    Ok(facts)
}

/// Where a kernel's image comes from: a file of the attention catalogue, or the training
/// ops' file (`cuda/train/train.cu`, launched by name from `crate::train`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    Attention(File),
    Train,
}

impl Source {
    /// `(sm90a, sm80)` images of the file (build.rs names them by the file's path).
    fn sets(self) -> (ptx::Parts, ptx::Parts) {
        match self {
            Self::Attention(File::Sm80Fwd) => (ptx::sm90a::SM80_FWD, ptx::sm80::SM80_FWD),
            Self::Attention(File::Sm80Bwd) => (ptx::sm90a::SM80_BWD, ptx::sm80::SM80_BWD),
            Self::Attention(File::Sm90Fwd) => (ptx::sm90a::SM90_FWD, ptx::sm80::SM90_FWD),
            Self::Attention(File::Sm90Bwd) => (ptx::sm90a::SM90_BWD, ptx::sm80::SM90_BWD),
            Self::Attention(File::Sm90FwdWs) => (ptx::sm90a::SM90_FWD_WS, ptx::sm80::SM90_FWD_WS),
            Self::Attention(File::Sm90BwdWs) => (ptx::sm90a::SM90_BWD_WS, ptx::sm80::SM90_BWD_WS),
            Self::Attention(File::Decode) => (ptx::sm90a::DECODE, ptx::sm80::DECODE),
            Self::Train => (ptx::sm90a::TRAIN, ptx::sm80::TRAIN),
        }
    }
}

/// Loaded kernels per device ordinal, by name: a launch finds its function with one lookup
/// (no module search, no driver call). A kernel name is unique within the set a device runs.
type Functions = HashMap<usize, HashMap<String, CudaFunction>>;
/// Loaded modules, per (device ordinal, file, set, dtype part): loading one (and, for PTX,
/// the driver's JIT) happens once per process. A module holds its context, so its handles
/// stay valid.
type Modules = Vec<((usize, Source, &'static str, &'static str), Arc<CudaModule>)>;

/// `kernel` of `source`, from the set the device runs: sm_90a on Hopper (where the file has
/// Hopper code; the sm80 image otherwise), sm_80 on Ampere, Ada and newer (and on Hopper
/// under `CANDLE_FLASH_ARCH=sm80`).
pub(crate) fn load_func(
    dev: &candle::CudaDevice,
    kernel: &str,
    source: Source,
) -> Result<CudaFunction> {
    static FUNCTIONS: Mutex<Option<Functions>> = Mutex::new(None);
    static MODULES: Mutex<Modules> = Mutex::new(Vec::new());
    let context = dev.cuda_stream().context().clone();
    let ordinal = context.ordinal();
    let mut functions = FUNCTIONS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let per_device = functions
        .get_or_insert_with(HashMap::new)
        .entry(ordinal)
        .or_default();
    if let Some(func) = per_device.get(kernel) {
        return Ok(func.clone());
    }
    let facts = device_facts(dev)?;
    let (hopper_parts, generic_parts) = source.sets();
    let (hopper_image, hopper_part) = hopper_parts.for_kernel(kernel);
    let (generic_image, generic_part) = generic_parts.for_kernel(kernel);
    let (set, part, image) = match (facts.hopper(), hopper_image, generic_image) {
        (true, Some(i), _) => ("sm90a", hopper_part, i),
        (_, _, Some(i)) => ("sm80", generic_part, i),
        _ => bail!(
            "{kernel}: this build of candle-flash has no {source:?} kernels for compute \
             capability {}.x (it was built for other GPUs: see CANDLE_FLASH_SASS / \
             CUDA_COMPUTE_CAP in the README)",
            facts.major
        ),
    };
    let key = (ordinal, source, set, part);
    let module = {
        let mut modules = MODULES
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match modules.iter().find(|(k, _)| *k == key) {
            Some((_, m)) => m.clone(),
            None => {
                let module = context
                    .load_module(Ptx::from_binary(image.0.to_vec()))
                    .w()?;
                modules.push((key, module.clone()));
                module
            }
        }
    };
    let func = module.load_function(kernel).w()?;
    per_device.insert(kernel.to_string(), func.clone());
    Ok(func)
}

/// Buffers kept per stream ([`StreamKey`]: per host thread on Candle's per-thread default
/// stream) and grown on demand, so that launches that may overlap never share one: the
/// arrival counters that kernels keep zero between launches (they reset them themselves, so
/// a call needs no memset of its own; four threads sharing one set raced in split-KV
/// decoding, a merge running before its splits arrived, seen under compute-sanitizer's
/// racecheck), and scratch that one launch writes and reads (split-KV partial results), which
/// would otherwise be an allocation and a free per call, two memory nodes more in a CUDA
/// graph. Entries live until exit (sized for the largest launch their stream saw), and so do
/// outgrown ones. Hold the cache's lock until the launch is queued: another call on the
/// stream must not replace them in between.
pub(crate) type StreamBuffers<T> = Vec<(StreamKey, CudaSlice<T>)>;
pub(crate) type StreamCounters = StreamBuffers<u32>;

/// Buffers that were outgrown, alive until exit (see [`stream_buffer`]).
static RETIRED: Mutex<Vec<Box<dyn std::any::Any + Send>>> = Mutex::new(Vec::new());

/// `dev`'s stream's buffer of `cache`, at least `n` elements, zeroed when first allocated.
/// Grown only outside a CUDA graph capture (an allocation made while capturing belongs to
/// the graph): run a step once eagerly before capturing it.
pub(crate) fn stream_buffer<'a, T: DeviceRepr + ValidAsZeroBits + Send + 'static>(
    cache: &'a mut StreamBuffers<T>,
    dev: &candle::CudaDevice,
    n: usize,
) -> Result<&'a mut CudaSlice<T>> {
    let stream = dev.cuda_stream();
    let key = stream_key(&stream);
    let i = cache.iter().position(|(k, _)| *k == key);
    if i.is_some_and(|i| cache[i].1.len() >= n) {
        return Ok(&mut cache[i.expect("checked")].1);
    }
    let capturing =
        stream.capture_status().w()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    if capturing {
        bail!(
            "a per-stream buffer of {n} elements would be allocated inside a CUDA graph \
             capture; run the captured calls once before capturing them"
        )
    }
    let fresh = dev.alloc_zeros::<T>(n.next_power_of_two())?;
    Ok(match i {
        Some(i) => {
            // The old slice is kept, not freed: a CUDA graph captured with it replays with
            // its address, and freed memory handed to another buffer would be written.
            let old = std::mem::replace(&mut cache[i].1, fresh);
            RETIRED
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(Box::new(old));
            &mut cache[i].1
        }
        None => {
            cache.push((key, fresh));
            &mut cache.last_mut().expect("pushed").1
        }
    })
}

/// The zeroed counters for `dev`'s stream, at least `n` of them (see [`StreamBuffers`]).
pub(crate) fn stream_counters<'a>(
    cache: &'a mut StreamCounters,
    dev: &candle::CudaDevice,
    n: usize,
) -> Result<&'a mut CudaSlice<u32>> {
    stream_buffer(cache, dev, n)
}

/// Whether outputs are filled with NaN before each launch, so that elements a kernel fails to
/// write show up in tests (`CANDLE_FLASH_POISON=1`).
fn poison_outputs() -> bool {
    overrides::overrides().poison
}

/// Fills a fresh allocation with 0xFF bytes: NaN in f16, bf16 and f32.
pub(crate) fn poison<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    buf: &mut CudaSlice<T>,
) -> Result<()> {
    if poison_outputs() {
        let bytes = buf.len() * std::mem::size_of::<T>();
        let (ptr, _sync) = buf.device_ptr_mut(stream);
        // SAFETY: ptr is a live allocation of `bytes` bytes, written in stream order.
        unsafe { memset_d8_async(ptr, 0xff, bytes, stream.cu_stream()) }.w()?;
    }
    Ok(())
}

/// One kernel launch: the kernel, its block and its dynamic shared memory (by default its
/// geometry's), and the grid.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Launch {
    pub kernel: Kernel,
    pub dtype: DType,
    pub grid: (usize, usize, usize),
    pub threads: u32,
    pub smem: u32,
    /// Blocks along y per thread-block cluster (1: no clusters).
    pub cluster_y: u32,
}

impl Launch {
    /// `kernel` for `dtype` on `grid`, with the block size and shared memory its traits give.
    pub fn new(kernel: Kernel, dtype: DType, grid: (usize, usize, usize)) -> Self {
        let g = kernel.geometry();
        Self {
            kernel,
            dtype,
            grid,
            threads: g.threads,
            smem: g.smem,
            cluster_y: 1,
        }
    }

    /// In thread-block clusters of `n` blocks along y (sm_90; `n` must divide the grid's y).
    pub fn cluster_y(self, n: u32) -> Self {
        Self {
            cluster_y: n,
            ..self
        }
    }

    /// With a block size of the launcher's choosing (for kernels whose traits fix none).
    pub fn threads(self, threads: u32) -> Self {
        Self { threads, ..self }
    }

    /// Launches it with one parameter block.
    pub fn run<P: DeviceRepr>(&self, dev: &candle::CudaDevice, params: &P) -> Result<()> {
        let name = self.kernel.name(self.dtype)?;
        let source = Source::Attention(self.kernel.file());
        launch(
            dev,
            source,
            name,
            self.grid,
            self.threads,
            self.smem,
            params,
        )
    }

    /// [`Launch::run`] with programmatic stream serialization on Hopper: the kernel's blocks
    /// may be dispatched while the kernel ahead of it in the stream finishes, so the launch
    /// overlaps that tail. Only for kernels that call `pdl_wait` (cuda/common/pdl.cuh) before
    /// they touch global memory. A plain launch elsewhere, or when `CANDLE_FLASH_PDL=0`.
    pub fn run_programmatic<P: DeviceRepr>(
        &self,
        dev: &candle::CudaDevice,
        params: &P,
    ) -> Result<()> {
        let name = self.kernel.name(self.dtype)?;
        let source = Source::Attention(self.kernel.file());
        let (grid, threads, smem) = (self.grid, self.threads, self.smem);
        let mut args = [params as *const P as *mut std::ffi::c_void];
        // SAFETY: as in `launch`: the parameter block describes live allocations of the sizes
        // the kernel indexes, and it outlives the call (the driver copies it at launch).
        unsafe {
            launch_args_clustered(
                dev,
                source,
                name,
                grid,
                threads,
                smem,
                self.cluster_y,
                &mut args,
            )
        }
    }
}

/// Launches `name` from `source` with one parameter block.
fn launch<P: DeviceRepr>(
    dev: &candle::CudaDevice,
    source: Source,
    name: &str,
    grid: (usize, usize, usize),
    threads: u32,
    smem: u32,
    params: &P,
) -> Result<()> {
    let Some((func, cfg)) = prepare_launch(dev, source, name, grid, threads, smem)? else {
        return Ok(());
    };
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(params);
    // SAFETY: the parameter block describes live allocations of the sizes the kernel indexes
    // (shapes checked by `params::validate`, buffers allocated by the caller for them).
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}

/// Launches `name` from `source` with `args` (one pointer per kernel parameter, to a value of
/// that parameter's type), programmatically on Hopper: the kernel's blocks may be dispatched
/// while the kernel ahead of it in the stream finishes. Only for kernels that call
/// `pdl_wait` (cuda/common/pdl.cuh) before they touch memory another kernel writes. A plain
/// launch elsewhere, or when `CANDLE_FLASH_PDL=0`.
///
/// # Safety
/// Each pointer must point to a live value of its parameter's type, and the values must
/// describe live allocations of the sizes the kernel indexes.
pub(crate) unsafe fn launch_args_programmatic(
    dev: &candle::CudaDevice,
    source: Source,
    name: &str,
    grid: (usize, usize, usize),
    threads: u32,
    smem: u32,
    args: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { launch_args_clustered(dev, source, name, grid, threads, smem, 1, args) }
}

/// [`launch_args_programmatic`] in thread-block clusters of `cluster_y` blocks along y (1:
/// none; more only on sm_90, where the caller checked with [`max_active_clusters`] that they
/// fit).
///
/// # Safety
/// As for [`launch_args_programmatic`].
#[allow(clippy::too_many_arguments)]
unsafe fn launch_args_clustered(
    dev: &candle::CudaDevice,
    source: Source,
    name: &str,
    grid: (usize, usize, usize),
    threads: u32,
    smem: u32,
    cluster_y: u32,
    args: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    let Some((func, cfg)) = prepare_launch(dev, source, name, grid, threads, smem)? else {
        return Ok(());
    };
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    // SAFETY: zero is a valid bit pattern for this plain C struct; ids and values are set.
    let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
    let mut n_attrs = 0;
    // Off (or before Hopper): the same call without the attribute, a plain launch.
    let programmatic = !overrides::overrides().pdl_off && device_facts(dev)?.hopper();
    if programmatic {
        // Inside graph::CapturedGraph::capture: joined to the kernels ahead past the stream's
        // frees, programmatically.
        crate::graph::before_programmatic_launch(&stream)?;
        attrs[n_attrs].id =
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n_attrs].value.programmaticStreamSerializationAllowed = 1;
        n_attrs += 1;
    }
    if cluster_y > 1 {
        allow_cluster_size(&func, cluster_y)?;
        attrs[n_attrs].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attrs[n_attrs].value.clusterDim.x = 1;
        attrs[n_attrs].value.clusterDim.y = cluster_y;
        attrs[n_attrs].value.clusterDim.z = 1;
        n_attrs += 1;
    }
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: n_attrs as u32,
    };
    // SAFETY: the caller's contract for `args`; the function belongs to the stream's context.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .w()?;
    Ok(())
}

/// Lets `func` run in clusters of `size` blocks: past the portable 8, the function must opt in
/// to larger (non-portable) clusters.
fn allow_cluster_size(func: &CudaFunction, size: u32) -> Result<()> {
    if size > 8 {
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
            1,
        )
        .w()?;
    }
    Ok(())
}

/// How many blocks of the kernel `name` of `source` (`threads` threads and `smem` bytes of
/// dynamic shared memory each) one multiprocessor of `dev` holds at once.
pub(crate) fn resident_blocks(
    dev: &candle::CudaDevice,
    source: Source,
    name: &'static str,
    threads: u32,
    smem: u32,
) -> Result<usize> {
    driver_answer(dev, source, name, (threads, smem, 0), |func| {
        // The occupancy calculator refuses more dynamic shared memory than the attribute
        // allows.
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .w()?;
        Ok(func
            .occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
            .w()? as usize)
    })
}

/// [`max_active_clusters`] of the kernel `name` of `source`.
pub(crate) fn resident_clusters(
    dev: &candle::CudaDevice,
    source: Source,
    name: &'static str,
    threads: u32,
    smem: u32,
    cluster_y: u32,
) -> Result<usize> {
    driver_answer(dev, source, name, (threads, smem, cluster_y), |func| {
        max_active_clusters(dev, func, threads, smem, cluster_y)
    })
}

/// `ask(the function name)`, asked once per (device, name, `question`) and cached: the
/// driver's occupancy answers, which a decoding step would otherwise ask for every layer.
fn driver_answer(
    dev: &candle::CudaDevice,
    source: Source,
    name: &'static str,
    question: (u32, u32, u32),
    ask: impl FnOnce(&CudaFunction) -> Result<usize>,
) -> Result<usize> {
    type Known = Vec<(usize, &'static str, (u32, u32, u32), usize)>;
    static KNOWN: Mutex<Known> = Mutex::new(Vec::new());
    let ordinal = dev.cuda_stream().context().ordinal();
    let mut known = KNOWN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(&(.., n)) = known
        .iter()
        .find(|&&(o, k, q, _)| o == ordinal && k == name && q == question)
    {
        return Ok(n);
    }
    let n = ask(&load_func(dev, name, source)?)?;
    known.push((ordinal, name, question, n));
    Ok(n)
}

/// How many clusters of `cluster_y` blocks (along y) of `func`, `threads` a block and `smem`
/// bytes of dynamic shared memory each, the device runs at once (0 if none fit, or before
/// sm_90, which has no clusters).
fn max_active_clusters(
    dev: &candle::CudaDevice,
    func: &CudaFunction,
    threads: u32,
    smem: u32,
    cluster_y: u32,
) -> Result<usize> {
    if !device_facts(dev)?.hopper() {
        return Ok(0);
    }
    dev.cuda_stream().context().bind_to_thread().w()?;
    allow_cluster_size(func, cluster_y)?;
    func.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .w()?;
    // SAFETY: zero is a valid bit pattern for these plain C structs; the fields read are set.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = 1;
    attr.value.clusterDim.y = cluster_y;
    attr.value.clusterDim.z = 1;
    let mut config: sys::CUlaunchConfig = unsafe { std::mem::zeroed() };
    config.gridDimX = 1;
    config.gridDimY = cluster_y;
    config.gridDimZ = 1;
    config.blockDimX = threads;
    config.blockDimY = 1;
    config.blockDimZ = 1;
    config.sharedMemBytes = smem;
    config.attrs = &mut attr;
    config.numAttrs = 1;
    let mut n = 0i32;
    // SAFETY: `config` and `n` are live for the call; the function belongs to the bound context.
    let r = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, func.cu_function(), &config) };
    // A cluster shape the device cannot run at all is an answer (none), not an error.
    Ok(match r {
        sys::CUresult::CUDA_SUCCESS => n.max(0) as usize,
        _ => 0,
    })
}

/// The function `name` of `source`, its dynamic shared memory allowed, and the launch shape;
/// `None` for an empty grid (nothing to launch).
pub(crate) fn prepare_launch(
    dev: &candle::CudaDevice,
    source: Source,
    name: &str,
    (x, y, z): (usize, usize, usize),
    threads: u32,
    smem: u32,
) -> Result<Option<(CudaFunction, LaunchConfig)>> {
    if x > i32::MAX as usize || y > 65535 || z > 65535 {
        bail!(
            "{name}: launch grid ({x}, {y}, {z}) exceeds CUDA's limits (too many heads or batches)"
        )
    }
    if x == 0 || y == 0 || z == 0 {
        return Ok(None);
    }
    let limit = device_facts(dev)?.smem;
    if smem as usize > limit {
        bail!("{name}: needs {smem} bytes of shared memory per block, the device allows {limit}")
    }
    let func = load_func(dev, name, source)?;
    func.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .w()?;
    let cfg = LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    Ok(Some((func, cfg)))
}
