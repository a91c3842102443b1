"""The ``gpt-lightning`` commands beyond Lightning's own fit / validate / test: ``bench``, ``sample``,
``export`` and ``tokenize``. Each module has a ``main(argv)``; ``gpt_lightning.cli`` dispatches to them."""
