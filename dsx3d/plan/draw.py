"""Draw a layout: nodes as boxes, GPUs coloured by pipeline stage, TP groups outlined, DP groups linked, with
expert parallelism the blocks of ranks that exchange tokens (each block's ranks of one TP index form an EP
group) in dotted frames, and with context parallelism the blocks of cp x tp ranks that split one sequence
(each block's ranks of one TP index form a CP group) in dash-dotted frames.

Uses matplotlib's object API (`Figure`), never pyplot, so no GUI backend or global state is involved;
the file format follows the file name (.svg, .png, .pdf).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.artist import Artist
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

from dsx3d.errors import UserError
from dsx3d.plan.layout import Layout

COLS = 8  # GPUs per row inside a node box
CELL, GAP, NODE_GAP = 1.0, 0.3, 0.9
MAX_RANKS = 512  # beyond this the picture is unreadable


def draw_plan(layout: Layout, path: str | Path) -> Path:
    if layout.world_size > MAX_RANKS:
        raise UserError.single(
            "--svg",
            str(path),
            f"a world of {layout.world_size} ranks is too large to draw",
            f"draw at most {MAX_RANKS}",
        )
    grid = _Grid(layout)
    fig = Figure(figsize=(1.1 * grid.width + 1.5, 1.1 * grid.height + 1.0))
    ax = fig.add_subplot()
    ax.set_xlim(-0.8, grid.width + 0.3)
    ax.set_ylim(-grid.height + NODE_GAP - 0.3, 0.9)
    ax.set_aspect("equal")
    ax.axis("off")
    colors = [colormaps["tab10"](s % 10) for s in range(layout.pp)]
    _draw_nodes(ax, layout, grid)
    _draw_gpus(ax, layout, grid, colors)
    _draw_tp_groups(ax, layout, grid)
    _draw_dp_groups(ax, layout, grid)
    _draw_ep_blocks(ax, layout, grid)
    _draw_cp_blocks(ax, layout, grid)
    ep = f" (ep {layout.ep})" if layout.ep > 1 else ""
    cp = f" x cp {layout.cp}" if layout.cp > 1 else ""
    ax.set_title(
        f"dp {layout.dp}{ep}{cp} x tp {layout.tp} x pp {layout.pp} on {layout.num_nodes} node(s) x "
        f"{layout.gpus_per_node} GPUs (world {layout.world_size})"
    )
    handles: list[Artist] = [Patch(color=colors[s], label=f"stage {s}") for s in range(layout.pp)]
    handles += [
        Patch(facecolor="none", edgecolor="black", linewidth=2, label="TP group"),
        Line2D([], [], color="dimgray", linestyle="--", label="DP group"),
    ]
    if layout.ep > 1:
        handles.append(Patch(facecolor="none", edgecolor="crimson", linestyle=":", linewidth=2, label="EP groups (all-to-all)"))
    if layout.cp > 1:
        handles.append(
            Patch(facecolor="none", edgecolor="navy", linestyle="-.", linewidth=2, label="CP groups (sequence split)")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    return out


class _Grid:
    """Where each rank's cell sits: node boxes stacked top to bottom, COLS cells per row inside."""

    def __init__(self, layout: Layout):
        self.cols = min(COLS, layout.gpus_per_node)
        self.rows = -(-layout.gpus_per_node // self.cols)
        self.node_height = self.rows * (CELL + GAP) + 0.5
        self.width = self.cols * (CELL + GAP)
        self.height = layout.num_nodes * (self.node_height + NODE_GAP)

    def cell(self, rank: int, gpus_per_node: int) -> tuple[float, float]:
        """Lower-left corner of the rank's cell."""
        node, local = divmod(rank, gpus_per_node)
        row, col = divmod(local, self.cols)
        top = -node * (self.node_height + NODE_GAP) - 0.5
        return col * (CELL + GAP), top - (row + 1) * (CELL + GAP) + GAP

    def node_origin(self, node: int) -> tuple[float, float]:
        return -GAP, -node * (self.node_height + NODE_GAP) - self.node_height


def _draw_nodes(ax, layout: Layout, grid: _Grid) -> None:
    for node in range(layout.num_nodes):
        x, y = grid.node_origin(node)
        ax.add_patch(
            FancyBboxPatch(
                (x, y),
                grid.width + GAP,
                grid.node_height,
                boxstyle="round,pad=0.05",
                facecolor="#f4f4f4",
                edgecolor="gray",
            )
        )
        ax.text(x + 0.1, y + grid.node_height - 0.25, f"node {node}", fontsize=9, va="center")


def _draw_gpus(ax, layout: Layout, grid: _Grid, colors: list) -> None:
    for p in layout.placements():
        x, y = grid.cell(p.rank, layout.gpus_per_node)
        ax.add_patch(Rectangle((x, y), CELL, CELL, facecolor=colors[p.pp], edgecolor="white", alpha=0.85))
        label = f"{p.rank}\npp{p.pp} dp{p.dp}\ntp{p.tp}" + (f" ep{layout.ep_rank(p.rank)}" if layout.ep > 1 else "")
        label += f" cp{p.cp}" if layout.cp > 1 else ""
        ax.text(x + CELL / 2, y + CELL / 2, label, ha="center", va="center", fontsize=6)


def _draw_tp_groups(ax, layout: Layout, grid: _Grid) -> None:
    """One outline per TP group and row (TP ranks are adjacent, so a group is one run of cells)."""
    for group in layout.tp_groups():
        rows: dict[float, list[float]] = {}
        for rank in group:
            x, y = grid.cell(rank, layout.gpus_per_node)
            rows.setdefault(y, []).append(x)
        for y, xs in rows.items():
            x0, x1 = min(xs), max(xs) + CELL
            ax.add_patch(
                Rectangle((x0 - 0.08, y - 0.08), x1 - x0 + 0.16, CELL + 0.16, fill=False, linewidth=2)
            )


def _draw_dp_groups(ax, layout: Layout, grid: _Grid) -> None:
    """Dashed arcs between consecutive members of each DP group, from the bottom of one cell to the next."""
    for group in layout.dp_groups():
        for a, b in zip(group, group[1:]):
            (xa, ya), (xb, yb) = grid.cell(a, layout.gpus_per_node), grid.cell(b, layout.gpus_per_node)
            arc = FancyArrowPatch(
                (xa + CELL / 2, ya + 0.1),
                (xb + CELL / 2, yb + 0.1),
                connectionstyle="arc3,rad=0.35",
                arrowstyle="-",
                linestyle="--",
                color="dimgray",
                linewidth=1,
            )
            ax.add_patch(arc)


def _draw_ep_blocks(ax, layout: Layout, grid: _Grid) -> None:
    """One dotted frame per row of each EP block: the tp x ep consecutive ranks whose EP groups (one per TP
    index) exchange tokens all-to-all and split every MoE layer's experts."""
    blocks: dict[tuple[int, int], set[int]] = {}
    for group in layout.ep_groups():
        first = layout.placement(group[0])
        blocks.setdefault((first.pp, first.dp), set()).update(group)
    _frame_blocks(ax, layout, grid, blocks.values(), 0.16, ":", "crimson")


def _draw_cp_blocks(ax, layout: Layout, grid: _Grid) -> None:
    """One dash-dotted frame per row of each CP block: the cp x tp consecutive ranks of one stage and DP index,
    whose CP groups (one per TP index) split the same sequences."""
    blocks: dict[tuple[int, int], set[int]] = {}
    for group in layout.cp_groups():
        first = layout.placement(group[0])
        blocks.setdefault((first.pp, first.dp), set()).update(group)
    _frame_blocks(ax, layout, grid, blocks.values(), 0.13, "-.", "navy")


def _frame_blocks(ax, layout: Layout, grid: _Grid, blocks, pad: float, style: str, color: str) -> None:
    for ranks in blocks:
        rows: dict[float, list[float]] = {}
        for rank in ranks:
            x, y = grid.cell(rank, layout.gpus_per_node)
            rows.setdefault(y, []).append(x)
        for y, xs in rows.items():
            x0, x1 = min(xs), max(xs) + CELL
            ax.add_patch(
                Rectangle(
                    (x0 - pad, y - pad),
                    x1 - x0 + 2 * pad,
                    CELL + 2 * pad,
                    fill=False,
                    linewidth=2,
                    linestyle=style,
                    edgecolor=color,
                )
            )
