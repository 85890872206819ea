"""Backends: where instances run. ``base`` is the typed boundary the controller speaks (see its
design note), ``registry`` finds a backend by name; ``local``, ``ray`` and ``testbed`` are the
built-in ones."""
