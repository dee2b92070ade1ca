"""Pruning: masks on a schedule, criteria, N:M patterns, layer selection, sensitivity, channels."""
