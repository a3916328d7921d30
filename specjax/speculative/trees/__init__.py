"""Draft trees: static shapes (`tree`), dynamic EAGLE-2 trees grown per row and round (`dynamic`),
drafting a static tree with a model (`drafting`) and the multi-step acceptance rule over a tree
(`acceptance`). A chain is the simplest tree."""
