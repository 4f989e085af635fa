"""Pure planning: inventory + job in, a printable plan out, contacting nothing. plan (one action
list per node), jobspec (the launch contract every backend keeps), sizing (each node's share of
the job's memory), elastic (the layout over the nodes a run has now), kube_export (the job as a
JobSet manifest)."""
