"""The guides' ``mypkg``: ``mypkg.train`` (a module run with ``-m``) and ``mypkg.models``."""
