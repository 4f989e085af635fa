"""Several torch.distributed processes on gloo (marker multiproc): layouts equal one process."""
