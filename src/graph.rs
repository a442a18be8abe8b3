//! CUDA graphs that keep the kernels' programmatic launches.
//!
//! Candle allocates every output with `cuMemAllocAsync` and frees it with `cuMemFreeAsync`;
//! under stream capture each becomes a memory node, so a captured step alternates kernel and
//! memory nodes. A programmatic (PDL) dependency only joins two kernel nodes, so inside such
//! a graph every kernel waited for the full completion of the one before it, the gap that
//! programmatic launch closes eagerly. A graph's dependencies cannot be edited once it holds
//! memory nodes, so [`CapturedGraph::capture`] shapes them while capturing: this crate's
//! launchers allocate their outputs as roots of the graph (no dependency on the kernels
//! before; such memory is never shared with a buffer the graph freed earlier), and a kernel
//! launched programmatically depends on the nodes the stream's frees followed instead of on
//! the frees, programmatically on kernels. Kernels of other libraries, and plain captures
//! (`CudaStream::begin_capture`), are recorded as they are.
//!
//! The price: the crate's allocations in the graph hold memory of their own for the whole
//! replay (a decoding step's are small; a captured training step's may not be).
//!
//! ```no_run
//! # fn main() -> candle::Result<()> {
//! # let dev = candle::Device::new_cuda(0)?;
//! # let step = || -> candle::Result<()> { Ok(()) };
//! step()?; // once eagerly: modules loaded, per-stream buffers grown outside the capture
//! let (graph, ()) = candle_flash::graph::CapturedGraph::capture(&dev, step)?;
//! graph.launch()?;
//! # Ok(()) }
//! ```

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use candle::cuda_backend::cudarc::driver::{sys, CudaStream};
use candle::{bail, Device, Result};

/// How a capture is turned into a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wiring {
    /// The graph as captured (what `CudaStream::end_capture` instantiates).
    AsCaptured,
    /// Memory nodes kept out of the kernels' chain, kernels joined programmatically where
    /// they were launched so (the default).
    Programmatic,
}

/// What a graph is made of: node counts by kind and its dependency edges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Kernel nodes.
    pub kernels: usize,
    /// Memory allocation nodes.
    pub allocs: usize,
    /// Memory free nodes.
    pub frees: usize,
    /// Every other node (copies, memsets, events, ...).
    pub others: usize,
    /// Dependency edges.
    pub edges: usize,
    /// Of those, programmatic ones (kernel to kernel).
    pub programmatic: usize,
    /// Plain edges from one kernel node straight to another.
    pub kernel_to_kernel: usize,
}

impl fmt::Display for GraphStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} kernels, {} allocs, {} frees, {} other nodes; {} edges ({} programmatic, {} plain kernel-to-kernel)",
            self.kernels,
            self.allocs,
            self.frees,
            self.others,
            self.edges,
            self.programmatic,
            self.kernel_to_kernel
        )
    }
}

/// An instantiated CUDA graph captured on a device's stream (see the module docs).
pub struct CapturedGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: Arc<CudaStream>,
    stats: GraphStats,
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `capture` and are destroyed once, here.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

impl CapturedGraph {
    /// Runs `body` under stream capture on `device`'s stream (nothing executes) and
    /// instantiates what it launched, [`Wiring::Programmatic`] (`CANDLE_FLASH_GRAPH=captured`:
    /// [`Wiring::AsCaptured`], for comparisons). Run the body once eagerly first: kernel
    /// modules load and per-stream buffers grow outside the capture.
    pub fn capture<R>(device: &Device, body: impl FnOnce() -> Result<R>) -> Result<(Self, R)> {
        let wiring = match crate::cuda::overrides().graph_as_captured {
            true => Wiring::AsCaptured,
            false => Wiring::Programmatic,
        };
        Self::capture_with(device, wiring, body)
    }

    /// [`CapturedGraph::capture`] with the wiring chosen.
    pub fn capture_with<R>(
        device: &Device,
        wiring: Wiring,
        body: impl FnOnce() -> Result<R>,
    ) -> Result<(Self, R)> {
        let Device::Cuda(dev) = device else {
            bail!("device: CUDA graphs need a CUDA device, got {device:?}")
        };
        let stream = dev.cuda_stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(candle::Error::wrap)?;
        let out = {
            let _shaping = Shaping::set(wiring == Wiring::Programmatic);
            body()
        };
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is in capture mode, begun above on this thread.
        let ended = unsafe { sys::cuStreamEndCapture(stream.cu_stream(), &mut graph) }.result();
        let out = match (out, ended) {
            (Err(e), _) => {
                destroy_graph(graph);
                return Err(e);
            }
            (Ok(_), Err(e)) => return Err(candle::Error::wrap(e)),
            (Ok(out), Ok(())) => out,
        };
        if graph.is_null() {
            bail!("graph capture: the body launched nothing")
        }
        let result = (|| {
            let stats = graph_stats(graph)?;
            let mut exec: sys::CUgraphExec = std::ptr::null_mut();
            let flags =
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
            // SAFETY: `graph` is a valid graph; `exec` receives the executable.
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, flags.0 as u64) }
                .result()
                .map_err(candle::Error::wrap)?;
            Ok((exec, stats))
        })();
        match result {
            Ok((exec, stats)) => Ok((
                Self {
                    graph,
                    exec,
                    stream,
                    stats,
                },
                out,
            )),
            Err(e) => {
                destroy_graph(graph);
                Err(e)
            }
        }
    }

    /// Replays the graph on the stream it was captured on.
    pub fn launch(&self) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(candle::Error::wrap)?;
        // SAFETY: `exec` is a live executable graph of this stream's context.
        unsafe { sys::cuGraphLaunch(self.exec, self.stream.cu_stream()) }
            .result()
            .map_err(candle::Error::wrap)
    }

    /// What the graph holds.
    pub fn stats(&self) -> GraphStats {
        self.stats
    }
}

fn destroy_graph(graph: sys::CUgraph) {
    if !graph.is_null() {
        // SAFETY: a graph returned by cuStreamEndCapture, destroyed once.
        unsafe {
            let _ = sys::cuGraphDestroy(graph);
        }
    }
}

fn check(r: sys::CUresult) -> Result<()> {
    r.result().map_err(candle::Error::wrap)
}

fn node_type(node: sys::CUgraphNode) -> Result<sys::CUgraphNodeType> {
    let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY: `node` is a live node of a graph (or of a capture in progress).
    check(unsafe { sys::cuGraphNodeGetType(node, &mut t) })?;
    Ok(t)
}

fn programmatic_edge() -> sys::CUgraphEdgeData {
    sys::CUgraphEdgeData {
        from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
        to_port: 0,
        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
        reserved: [0; 5],
    }
}

fn plain_edge() -> sys::CUgraphEdgeData {
    sys::CUgraphEdgeData {
        from_port: 0,
        to_port: 0,
        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8,
        reserved: [0; 5],
    }
}

/// Counts `graph`'s nodes by kind and its edges.
fn graph_stats(graph: sys::CUgraph) -> Result<GraphStats> {
    use sys::CUgraphNodeType as N;
    let mut n = 0usize;
    // SAFETY: a null array asks for the count only.
    check(unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) })?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` holds `n` entries.
    check(unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) })?;
    let mut s = GraphStats::default();
    let mut kernels = HashSet::new();
    for &node in nodes.iter().take(n) {
        match node_type(node)? {
            N::CU_GRAPH_NODE_TYPE_KERNEL => {
                kernels.insert(node);
            }
            N::CU_GRAPH_NODE_TYPE_MEM_ALLOC => s.allocs += 1,
            N::CU_GRAPH_NODE_TYPE_MEM_FREE => s.frees += 1,
            _ => s.others += 1,
        }
    }
    s.kernels = kernels.len();
    let mut m = 0usize;
    // SAFETY: null arrays ask for the count only.
    check(unsafe {
        sys::cuGraphGetEdges_v2(
            graph,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut m,
        )
    })?;
    let mut from = vec![std::ptr::null_mut(); m];
    let mut to = vec![std::ptr::null_mut(); m];
    let mut data = vec![plain_edge(); m];
    // SAFETY: each array holds `m` entries.
    check(unsafe {
        sys::cuGraphGetEdges_v2(
            graph,
            from.as_mut_ptr(),
            to.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut m,
        )
    })?;
    s.edges = m;
    for i in 0..m {
        if data[i].type_ == programmatic_edge().type_ {
            s.programmatic += 1;
        } else if kernels.contains(&from[i]) && kernels.contains(&to[i]) {
            s.kernel_to_kernel += 1;
        }
    }
    Ok(s)
}

thread_local! {
    /// Whether this thread is inside [`CapturedGraph::capture`] with [`Wiring::Programmatic`].
    static SHAPING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Sets [`SHAPING`] for the life of the value (restored on drop, also on a panic).
struct Shaping(bool);

impl Shaping {
    fn set(on: bool) -> Self {
        Self(SHAPING.with(|s| s.replace(on)))
    }
}

impl Drop for Shaping {
    fn drop(&mut self) {
        SHAPING.with(|s| s.set(self.0));
    }
}

/// The dependency set of `stream` when it is being captured inside
/// [`CapturedGraph::capture`] (programmatic wiring), `None` otherwise.
fn shaped_deps(
    stream: sys::CUstream,
) -> Result<Option<Vec<(sys::CUgraphNode, sys::CUgraphEdgeData)>>> {
    if !SHAPING.with(|s| s.get()) {
        return Ok(None);
    }
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut data: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut n = 0usize;
    // SAFETY: out-pointers to locals; the arrays returned stay valid until the next call on
    // the stream, and are copied before it.
    check(unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            &mut id,
            &mut graph,
            &mut deps,
            &mut data,
            &mut n,
        )
    })?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
        return Ok(None);
    }
    let nodes = match n {
        0 => vec![],
        // SAFETY: the driver returned `n` nodes (and edge data, when not null) at these addresses.
        _ => (0..n)
            .map(|i| unsafe {
                let d = match data.is_null() {
                    true => plain_edge(),
                    false => *data.add(i),
                };
                (*deps.add(i), d)
            })
            .collect(),
    };
    Ok(Some(nodes))
}

/// Replaces the dependency set of the capturing `stream`.
fn set_deps(
    stream: sys::CUstream,
    deps: &[(sys::CUgraphNode, sys::CUgraphEdgeData)],
) -> Result<()> {
    let mut nodes: Vec<_> = deps.iter().map(|(n, _)| *n).collect();
    let data: Vec<_> = deps.iter().map(|(_, d)| *d).collect();
    let flags = sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES;
    // SAFETY: two arrays of `deps.len()` entries naming nodes of the stream's capture graph.
    check(unsafe {
        sys::cuStreamUpdateCaptureDependencies_v2(
            stream,
            nodes.as_mut_ptr(),
            data.as_ptr(),
            nodes.len(),
            flags as u32,
        )
    })
}

/// Runs `alloc` (allocations on `stream`) so that, inside [`CapturedGraph::capture`], the
/// memory nodes it records are roots of the graph rather than successors of the kernels
/// before: the kernel that then writes the memory can be joined programmatically to those
/// kernels. Elsewhere it just runs `alloc`.
pub(crate) fn unchained<R>(stream: &CudaStream, alloc: impl FnOnce() -> Result<R>) -> Result<R> {
    let s = stream.cu_stream();
    let Some(saved) = shaped_deps(s)? else {
        return alloc();
    };
    set_deps(s, &[])?;
    let out = alloc();
    // The allocations' nodes (if any) join what the stream depended on before; on an
    // error in `alloc` too, so that the capture stays ordered.
    let mut deps = saved;
    deps.extend(shaped_deps(s)?.unwrap_or_default());
    set_deps(s, &deps)?;
    out
}

/// Called right before a programmatic launch on `stream`: inside [`CapturedGraph::capture`],
/// each memory-free node the launch would depend on is replaced by the nodes it depends on
/// (recursively), kernels among them by programmatic edges. The frees stay in the graph
/// after their predecessors; the kernel never touches what they free (its arguments are
/// alive). Allocations stay dependencies: the kernel may use their memory.
pub(crate) fn before_programmatic_launch(stream: &CudaStream) -> Result<()> {
    let s = stream.cu_stream();
    let Some(deps) = shaped_deps(s)? else {
        return Ok(());
    };
    let mut out: Vec<(sys::CUgraphNode, sys::CUgraphEdgeData)> = vec![];
    let mut seen = HashSet::new();
    let mut stack: Vec<_> = deps.iter().map(|(n, d)| (*n, Some(*d))).collect();
    let mut changed = false;
    while let Some((node, data)) = stack.pop() {
        if !seen.insert(node) {
            continue;
        }
        match node_type(node)? {
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE => {
                changed = true;
                let mut n = 0usize;
                // SAFETY: null arrays ask for the count only.
                check(unsafe {
                    sys::cuGraphNodeGetDependencies_v2(
                        node,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        &mut n,
                    )
                })?;
                let mut preds = vec![std::ptr::null_mut(); n];
                let mut data = vec![plain_edge(); n];
                // SAFETY: both arrays hold `n` entries.
                check(unsafe {
                    sys::cuGraphNodeGetDependencies_v2(
                        node,
                        preds.as_mut_ptr(),
                        data.as_mut_ptr(),
                        &mut n,
                    )
                })?;
                stack.extend(preds.into_iter().take(n).map(|p| (p, None)));
            }
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => {
                let edge = programmatic_edge();
                changed |= data.is_none_or(|d| d.type_ != edge.type_);
                out.push((node, edge));
            }
            _ => out.push((node, data.unwrap_or_else(plain_edge))),
        }
    }
    // A driver that refuses the new set leaves the stream's as it was: the launch is then
    // recorded as a plain capture records it.
    if changed {
        let _ = set_deps(s, &out);
    }
    Ok(())
}
