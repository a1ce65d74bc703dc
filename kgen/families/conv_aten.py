"""conv_aten: a convolution stage run by ATen (cuDNN on the GPU) from the generated binding.

One implementation of the conv stage (``kgen.stage.ConvStage``), in every
lowering: direct (also transposed), folded (the box-filtered weight is made at
run time) and sub-pixel (one ATen convolution per phase, each writing its own
tile, which the next fused stage reads in place). It picks the memory format
of its output and narrows its input to the prefix a cropped output needs.
Templates: ``templates/conv_aten/``.
"""
from __future__ import annotations

from dataclasses import asdict

from ..lowering import Subpixel, lowered
from ..stage import Buffer, ConvStage, Tile, dense_buffer, strides_of
from .base import Family, StageRequest


class ConvAten(Family):
    name = "conv_aten"
    stage_kind = "conv"
    generates_kernel = False
    pieces = ("binding.cpp",)
    summary = "ATen/cuDNN convolution, in the lowering the rewrites chose"

    def fits(self, ops):
        return len(ops) == 1 and lowered(ops[0]) is not None

    def unsupported(self, req: StageRequest) -> str | None:
        if req.pipeline.conv_impl == "gemm":
            return "the spec asks for the generated convolution (plan.conv: gemm)"
        return None

    def layout(self, req: StageRequest, conv) -> str:
        """The output's memory format: channels_last when the next stage reads it as fast
        (cuDNN is faster in channels_last, measured on the H100: notes/perf.md), except for
        a transposed convolution run as written."""
        if conv.conv.rank < 2:
            return "contiguous"  # ATen has no channels_last format for 1-d convolutions
        layout = req.pipeline.conv_layout
        if layout != "auto":
            return layout
        direct_transposed = conv.conv.transposed and not isinstance(conv.lowering, Subpixel)
        nxt = req.next_family
        fast = nxt is not None and nxt.reads_channels_last
        return "channels_last" if fast and not direct_transposed else "contiguous"

    def make_stage(self, req: StageRequest) -> ConvStage:
        conv = lowered(req.ops[0])
        t_in, t_out = req.types
        layout = self.layout(req, conv)
        C = conv.conv.out_channels
        st = ConvStage(req.index, list(req.ops), t_in, t_out, input=req.input, conv=conv, layout=layout)
        if isinstance(conv.lowering, Subpixel):
            st.phases = conv.phases(t_in.spatial)
            tiles = []
            for ph in st.phases:
                dims = (C,) + ph.conv_out
                strides, sample = strides_of(dims, layout)
                tiles.append(Tile(dims, strides, sample, ph.offset, ph.residue))
            # stride 1 has a single phase: a dense tile, maybe offset
            phase_stride = conv.conv.stride if len(tiles) > 1 else ()
            st.output = Buffer(t_out.shape[1:], layout, tuple(tiles), phase_stride=phase_stride)
            st.input_extent = st.phases[0].input_extent
            return st
        st.input_extent = conv.input_extent(t_in.spatial)
        # a cropped output is a view of what the convolution produces from the input prefix
        st.output = dense_buffer(t_out.shape[1:], (C,) + conv.physical_out(t_in.spatial), layout)
        return st

    def stage_json(self, st: ConvStage) -> dict:
        d = dict(lowering=st.conv.lowering.name, layout=st.layout, input_extent=list(st.input_extent))
        if st.phases:
            d["phases"] = [asdict(p) for p in st.phases]
        return d


FAMILY = ConvAten()
