"""The node agent: a process per node that owns the staging memory and writes and commits the
saves its trainers staged there, so that a save outlives the training process
(``docs/agent.md``).

:mod:`.server` is the agent, :mod:`.client` the trainer's side (an
:class:`~ckptd.writer.remote.Offload` for the Saver), :mod:`.shm` the shared memory and
:mod:`.wire` the socket, its messages and who may use it.
"""
