"""The ``gpt-lightning`` commands beyond Lightning's own, each a module with a ``main(argv)``."""
