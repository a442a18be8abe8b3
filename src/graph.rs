//! CUDA graphs that keep the kernels' programmatic launches.
//!
//! Candle allocates every output with `cuMemAllocAsync` and frees it with `cuMemFreeAsync`;
//! under stream capture each becomes a memory node, so a captured step alternates kernel and
//! memory nodes. A programmatic (PDL) dependency only exists between two kernel nodes, so
//! inside such a graph every kernel waits for the full completion of the one before it, the
//! gap that programmatic launch closes eagerly. [`CapturedGraph::capture`] records the same
//! step, then takes the memory nodes out of the kernels' chain before instantiating it:
//! allocations become roots of the graph and frees its sinks (each still ordered after every
//! node it followed), and the kernels they separated are joined directly, programmatically
//! where the later kernel was launched that way (it waits on the device for the one ahead
//! before touching memory), otherwise by a plain edge.
//!
//! The price: no allocation of the graph reuses memory another one freed, so a replay holds
//! all of the step's temporaries at once (a decoding step's are small; a captured training
//! step's may not be).
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

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use candle::cuda_backend::cudarc::driver::{sys, CudaStream};
use candle::{bail, Device, Result};

/// How a capture is turned into a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wiring {
    /// The graph as captured (what `CudaStream::end_capture` instantiates).
    AsCaptured,
    /// Memory nodes moved out of the kernels' chain, kernels joined programmatically where
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
    captured: GraphStats,
    launched: GraphStats,
}

// SAFETY: the handles are only used through &self methods that call the driver, which is
// thread safe for launching an executable graph; the graph itself is not touched after
// instantiation except to destroy it (Drop, which needs the value by value).
unsafe impl Send for CapturedGraph {}

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
        let out = body();
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
            let nodes = Nodes::read(graph)?;
            let captured = nodes.stats();
            if wiring == Wiring::Programmatic {
                nodes.rewire(graph)?;
            }
            let launched = Nodes::read(graph)?.stats();
            let mut exec: sys::CUgraphExec = std::ptr::null_mut();
            let flags =
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
            // SAFETY: `graph` is a valid graph; `exec` receives the executable.
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, flags.0 as u64) }
                .result()
                .map_err(candle::Error::wrap)?;
            Ok((exec, captured, launched))
        })();
        match result {
            Ok((exec, captured, launched)) => Ok((
                Self {
                    graph,
                    exec,
                    stream,
                    captured,
                    launched,
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

    /// The graph as captured.
    pub fn captured_stats(&self) -> GraphStats {
        self.captured
    }

    /// The graph as instantiated (after the rewiring).
    pub fn stats(&self) -> GraphStats {
        self.launched
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

/// Kernel functions launched with programmatic stream serialization (they call `pdl_wait`
/// before touching memory another kernel writes), as `CUfunction` addresses.
static PROGRAMMATIC: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

/// Records that `func` is launched programmatically (`crate::cuda::launch_args_programmatic`).
pub(crate) fn note_programmatic(func: sys::CUfunction) {
    let mut known = PROGRAMMATIC
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if !known.contains(&(func as usize)) {
        known.push(func as usize);
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Kernel { programmatic: bool },
    Alloc,
    Free,
    Other,
}

type Edge = (sys::CUgraphNode, sys::CUgraphNode);

/// A graph's nodes and edges as read from the driver.
struct Nodes {
    kinds: HashMap<sys::CUgraphNode, Kind>,
    /// In the driver's order (a capture's is the stream's).
    order: Vec<sys::CUgraphNode>,
    edges: Vec<(Edge, sys::CUgraphEdgeData)>,
}

fn check(r: sys::CUresult) -> Result<()> {
    r.result().map_err(candle::Error::wrap)
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

impl Nodes {
    fn read(graph: sys::CUgraph) -> Result<Self> {
        let mut n = 0usize;
        // SAFETY: a null array asks for the count only.
        check(unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) })?;
        let mut order = vec![std::ptr::null_mut(); n];
        // SAFETY: `order` holds `n` entries.
        check(unsafe { sys::cuGraphGetNodes(graph, order.as_mut_ptr(), &mut n) })?;
        order.truncate(n);
        let programmatic = PROGRAMMATIC
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        let mut kinds = HashMap::with_capacity(n);
        for &node in &order {
            let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: `node` belongs to `graph`.
            check(unsafe { sys::cuGraphNodeGetType(node, &mut t) })?;
            let kind = match t {
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => {
                    // SAFETY: zero is valid for this plain C struct; the driver fills it.
                    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
                    // SAFETY: `node` is a kernel node.
                    check(unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut p) })?;
                    Kind::Kernel {
                        programmatic: !p.func.is_null()
                            && programmatic.contains(&(p.func as usize)),
                    }
                }
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC => Kind::Alloc,
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE => Kind::Free,
                _ => Kind::Other,
            };
            kinds.insert(node, kind);
        }
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
        let edges = (0..m).map(|i| ((from[i], to[i]), data[i])).collect();
        Ok(Self {
            kinds,
            order,
            edges,
        })
    }

    fn stats(&self) -> GraphStats {
        let mut s = GraphStats::default();
        for kind in self.kinds.values() {
            match kind {
                Kind::Kernel { .. } => s.kernels += 1,
                Kind::Alloc => s.allocs += 1,
                Kind::Free => s.frees += 1,
                Kind::Other => s.others += 1,
            }
        }
        let is_kernel = |n| matches!(self.kinds.get(&n), Some(Kind::Kernel { .. }));
        for ((from, to), data) in &self.edges {
            s.edges += 1;
            if data.type_ == sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8
            {
                s.programmatic += 1;
            } else if is_kernel(*from) && is_kernel(*to) {
                s.kernel_to_kernel += 1;
            }
        }
        s
    }

    /// Takes each memory node out of the chain (allocations to the roots, frees to the sinks),
    /// joining its predecessors to its successors, then applies the difference to `graph`.
    fn rewire(&self, graph: sys::CUgraph) -> Result<()> {
        let mut edges: HashMap<Edge, sys::CUgraphEdgeData> = self.edges.iter().copied().collect();
        let mut preds: HashMap<sys::CUgraphNode, HashSet<sys::CUgraphNode>> = HashMap::new();
        let mut succs: HashMap<sys::CUgraphNode, HashSet<sys::CUgraphNode>> = HashMap::new();
        for &((f, t), _) in &self.edges {
            preds.entry(t).or_default().insert(f);
            succs.entry(f).or_default().insert(t);
        }
        for &x in &self.order {
            let kind = self.kinds[&x];
            if !matches!(kind, Kind::Alloc | Kind::Free) {
                continue;
            }
            let before: Vec<_> = preds.get(&x).into_iter().flatten().copied().collect();
            let after: Vec<_> = succs.get(&x).into_iter().flatten().copied().collect();
            for &p in &before {
                for &s in &after {
                    if edges.contains_key(&(p, s)) {
                        continue;
                    }
                    let data = match (self.kinds[&p], self.kinds[&s]) {
                        (Kind::Kernel { .. }, Kind::Kernel { programmatic: true }) => {
                            programmatic_edge()
                        }
                        _ => plain_edge(),
                    };
                    edges.insert((p, s), data);
                    preds.entry(s).or_default().insert(p);
                    succs.entry(p).or_default().insert(s);
                }
            }
            // An allocation keeps its successors and loses its predecessors; a free the
            // reverse.
            let cut: Vec<Edge> = match kind {
                Kind::Alloc => before.iter().map(|&p| (p, x)).collect(),
                _ => after.iter().map(|&s| (x, s)).collect(),
            };
            for (f, t) in cut {
                edges.remove(&(f, t));
                if let Some(s) = succs.get_mut(&f) {
                    s.remove(&t);
                }
                if let Some(p) = preds.get_mut(&t) {
                    p.remove(&f);
                }
            }
        }
        let old: HashMap<Edge, sys::CUgraphEdgeData> = self.edges.iter().copied().collect();
        let removed: Vec<_> = old
            .iter()
            .filter(|(e, _)| !edges.contains_key(e))
            .map(|(&e, &d)| (e, d))
            .collect();
        let added: Vec<_> = edges
            .iter()
            .filter(|(e, _)| !old.contains_key(e))
            .map(|(&e, &d)| (e, d))
            .collect();
        apply(graph, &added, true)?;
        apply(graph, &removed, false)
    }
}

/// Adds (or removes) `edges` in `graph`.
fn apply(graph: sys::CUgraph, edges: &[(Edge, sys::CUgraphEdgeData)], add: bool) -> Result<()> {
    if edges.is_empty() {
        return Ok(());
    }
    let from: Vec<_> = edges.iter().map(|((f, _), _)| *f).collect();
    let to: Vec<_> = edges.iter().map(|((_, t), _)| *t).collect();
    let data: Vec<_> = edges.iter().map(|(_, d)| *d).collect();
    // SAFETY: three arrays of `edges.len()` entries naming nodes of `graph`.
    check(unsafe {
        if add {
            sys::cuGraphAddDependencies_v2(
                graph,
                from.as_ptr(),
                to.as_ptr(),
                data.as_ptr(),
                edges.len(),
            )
        } else {
            sys::cuGraphRemoveDependencies_v2(
                graph,
                from.as_ptr(),
                to.as_ptr(),
                data.as_ptr(),
                edges.len(),
            )
        }
    })
}
