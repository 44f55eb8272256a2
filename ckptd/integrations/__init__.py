"""ckptd as the checkpointer of the frameworks users train with (``docs/integrations.md``).

::

    torchtitan.py   CkptdCheckpointManager: torchtitan's checkpointer seam (checkpoint.Config)
    lightning.py    CkptdCheckpointIO: Lightning's CheckpointIO plugin (Trainer and Fabric)

Each module imports its framework at the top, so importing it needs that framework installed;
nothing else in ckptd imports this package (an import-linter contract), so ``import ckptd``
never needs a framework. The runnable examples in the repository's ``integrations/`` folder are
a different thing: scripts, never imported by ckptd.
"""
