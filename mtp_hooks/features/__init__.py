"""One module per option: its per-forward fields, its code at each hook site and its attach-time check.
``hooks`` calls them, statically and in a fixed order; none of them imports ``hooks``."""
