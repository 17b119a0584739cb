"""What the tests, the demo and the notebooks run on every rank to compare the course's code with
the real thing (the ``numpy.testing`` / ``torch.testing`` convention): :mod:`.comm` for messages,
:mod:`.collectives` for the allreduces, :mod:`.ddp` for data-parallel training, :mod:`.local_sgd`
for torch DDP's compression hooks, :mod:`.pipeline` and :mod:`.tensor_parallel` for model
parallelism, :mod:`.zero` for sharded data parallelism, :mod:`.netem` for timings on the emulated
network, and :mod:`.torchft` (optional) for torchft's live recovery from a peer."""
