"""What a run leaves on disk: the run directory, atomic checkpoints, the metrics log and its rows,
the plot, and the initial model."""
