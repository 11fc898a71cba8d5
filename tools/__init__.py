"""Developer tools on top of the product: generators of files derived from its declarations."""
