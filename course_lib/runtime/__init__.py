"""What runs the lessons, and the course's own tools; no lesson lives here.

* ``cluster``: ``start_cluster`` (also ``from course_lib import start_cluster``), a local cluster
  of ipyparallel engines, each a rank of a torch.distributed process group; ``engine``: what runs
  on each engine (its rank, its process group, the rank demos); ``launch``: SLURM, mpiexec and
  torchrun launches and the cleaning up of processes; ``warm_start``: engines forked from a
  template that has imported PyTorch;
* ``netem``: the emulated network (every message pays a real link's time); ``hosts``: real hosts
  on one machine (network namespaces);
* ``timeline``: what each rank did and when; ``stacks``: where every rank is while a call hangs;
  ``fault_points``: named places where a process dies or hangs on purpose; ``tensorboard_view``:
  TensorBoard for the chief's run;
* ``doctor``, ``demo``, ``labs`` (the student labs built from their solutions), ``tables`` and
  ``arguments``: the command line's tools and the checks and tables the lessons share.
"""
