"""How a save fills the optimizer state files, one module per word of the ``checkpoint_copy`` setting:
``streamed`` (through memory), ``reflink`` (clones of the store's extents) and ``background`` (a copy-before-write
snapshot copied by a thread after the save returns). ``checkpoint.Saver`` picks one (``Saver.decide``)."""
