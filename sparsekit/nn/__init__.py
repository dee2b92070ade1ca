"""What prune, quant and accel all use: calibration capture (feeding batches to a model, the
one tree-map and im2col), layer selection by qualified name, work across ranks (process
groups, sharded tensors, sums over ranks) and GPU timing."""
