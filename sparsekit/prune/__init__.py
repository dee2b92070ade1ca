"""Pruning: masks on a schedule, criteria, N:M patterns, sensitivity, channels."""
