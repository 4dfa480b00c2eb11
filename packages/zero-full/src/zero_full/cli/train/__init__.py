"""``zero train``: the demo training run on N local processes."""
