"""The pieces of a training run that `dsx3d.train` strings together, one concern per module:

- `launch`: the `deepspeed` command line that `dsx3d train` runs (process count, hostfile);
- `ranks`: where this process sits (rank, node, host) and reporting a rank's failure;
- `outputs`: the run directory and the files saved beside the run;
- `data`: the data set-up of a rank (prepare once, barrier, stream by DP rank);
- checkpoints (tags, the atomic `latest` pointer, pruning, resume) live in `dsx3d.checkpoint.training`;
- `metrics`: throughput arithmetic and the append-only metrics.jsonl;
- `progress`: the rank-0 progress bar and log lines;
- `memory`: each rank's peak memory over a logging interval, gathered to rank 0;
- `plot`: the loss curve.
"""
