//! Graphs and stream capture.

use super::launches::pack_args;
use super::vmm::location;
use super::*;

fn add_kernel_node(
    s: &Sim,
    node: *mut CUgraphNode,
    g: CUgraph,
    p: *const CUDA_KERNEL_NODE_PARAMS_v1,
) -> CuResult<()> {
    let p: CUDA_KERNEL_NODE_PARAMS_v1 = inp!(p);
    let (kernel, dev) = s.function_to_launch(hv(p.func))?;
    let grid = [p.gridDimX, p.gridDimY, p.gridDimZ];
    let block = [p.blockDimX, p.blockDimY, p.blockDimZ];
    s.check_dims(grid, block, false)?;
    let args = pack_args(kernel, p.kernelParams, p.extra)?;
    out!(
        node,
        hp(s.graph_add_kernel(
            hv(g),
            Launch {
                kernel,
                dev,
                grid,
                block,
                args
            }
        )?)
    );
    Ok(())
}

exports! {
    cuGraphCreate(g: *mut CUgraph, _flags: c_uint) false |s| {
        out!(g, hp(s.graph_create()?));
        Ok(())
    }
    cuGraphDestroy(g: CUgraph) false |s| { s.graph_destroy(hv(g)) }
    cuGraphAddKernelNode(node: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _n: usize, p: *const CUDA_KERNEL_NODE_PARAMS_v1) false |s| {
        add_kernel_node(s, node, g, p)
    }
    cuGraphAddKernelNode_v2(node: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _n: usize, p: *const CUDA_KERNEL_NODE_PARAMS_v1) false |s| {
        add_kernel_node(s, node, g, p)
    }
    cuGraphAddEmptyNode(node: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _n: usize) false |s| {
        out!(node, hp(s.graph_add_empty(hv(g))?));
        Ok(())
    }
    cuGraphAddMemAllocNode(node: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _n: usize, params: *mut CUDA_MEM_ALLOC_NODE_PARAMS) true |s| {
        let mut p: CUDA_MEM_ALLOC_NODE_PARAMS = inp!(params);
        let ord = location(&p.poolProps.location)?.ok_or(CUDA_ERROR_NOT_SUPPORTED)?;
        let (n, dptr) = s.graph_add_mem_alloc(hv(g), ord, p.bytesize as u64)?;
        p.dptr = CUdeviceptr(dptr);
        out!(params, p);
        out!(node, hp(n));
        Ok(())
    }
    cuGraphAddMemFreeNode(node: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _n: usize, dptr: CUdeviceptr) false |s| {
        out!(node, hp(s.graph_add_mem_free(hv(g), dptr.0)?));
        Ok(())
    }
    cuGraphGetNodes(g: CUgraph, nodes: *mut CUgraphNode, count: *mut usize) false |s| {
        let all = s.graph_nodes(hv(g))?;
        if nodes.is_null() {
            out!(count, all.len());
            return Ok(());
        }
        let cap: usize = inp!(count);
        for (i, n) in all.iter().take(cap).enumerate() {
            out!(nodes.wrapping_add(i), hp(*n));
        }
        out!(count, all.len().min(cap));
        Ok(())
    }
    cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, g: CUgraph, _flags: u64) false |s| {
        out!(exec, hp(s.graph_instantiate(hv(g))?));
        Ok(())
    }
    cuGraphInstantiate_v2(exec: *mut CUgraphExec, g: CUgraph, err_node: *mut CUgraphNode, _log: *mut c_char, _n: usize) false |s| {
        out!(exec, hp(s.graph_instantiate(hv(g))?));
        if !err_node.is_null() {
            out!(err_node, std::ptr::null_mut());
        }
        Ok(())
    }
    cuGraphExecDestroy(exec: CUgraphExec) false |s| { s.graph_exec_destroy(hv(exec)) }
}
