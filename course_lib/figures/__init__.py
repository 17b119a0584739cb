"""The figures of the notebooks, one module per notebook topic. Every module's ``save_all(out_dir)``
writes its figures into ``images/``: ``python -m course_lib images`` calls them all."""
