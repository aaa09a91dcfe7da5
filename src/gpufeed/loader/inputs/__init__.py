"""What a Loader reads, one kind of input a module: a store packed in one file (`packed`), a sharded one
on this disk (`sharded`), one in a bucket read through its cache (`remote`), a folder, list or tar
shards read in place (`folder`). Each `Input` owns what its kind needs of a pass: the tier, the bytes
its JPEGs are read from, the shard-aware order's windows, the checks that the data did not change
and, for a bucket, the downloads ahead of the plan; and it closes what it opened. `open_input` is
where a kind is chosen: the Loader composes what it returns and names no store class."""

from gpufeed.loader.inputs.base import Input
from gpufeed.loader.inputs.opening import open_input, reads_in_place

__all__ = ["Input", "open_input", "reads_in_place"]
