"""`dsx3d plan --auto`: search layouts for a model and a cluster (filled in by the planner work)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auto", action="store_true", help="search layouts instead of showing one")


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("dsx3d plan --auto is not implemented yet")
