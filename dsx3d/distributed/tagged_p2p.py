"""Point-to-point messages between pipeline ranks that carry a tag, for ranks holding several model chunks.

With virtual stages two ranks exchange several streams (activations of chunk c, gradients of chunk c + 1, and
with pp = 2 both directions of the wrap-around link), so each message carries a tag naming its stream: a receive
matches the next send of its own stream, whatever the peer sent on the others. Sends are posted (they do not
wait for the receive) and kept alive until `wait`; receives block (`recv`) or are posted ahead (`post_recv`, then
`take`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class TaggedLinks:
    def __init__(self) -> None:
        self.works: list[tuple[Any, torch.Tensor]] = []

    def post(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.contiguous()
        self.works.append((dist.isend(tensor, dst, tag=tag), tensor))

    def recv(self, like: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        out = torch.empty_like(like)
        dist.recv(out, src, tag=tag)
        return out

    def post_recv(self, likes: list[tuple[torch.dtype, tuple[int, ...]]], src: int, tag: int, device: Any = None) -> list[tuple[Any, torch.Tensor]]:
        """Receives of one message (a tensor per (dtype, shape)) posted ahead; `take` waits for them."""
        out = []
        for dtype, shape in likes:
            buf = torch.empty(shape, dtype=dtype, device=device)
            out.append((dist.irecv(buf, src, tag=tag), buf))
        return out

    @staticmethod
    def take(posted: list[tuple[Any, torch.Tensor]]) -> list[torch.Tensor]:
        for work, _ in posted:
            work.wait()
        return [buf for _, buf in posted]

    def wait(self) -> int:
        works, self.works = self.works, []
        for work, _ in works:
            work.wait()
        return len(works)
