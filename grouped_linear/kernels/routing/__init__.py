"""Moving rows between layouts: padding, permutation and the routing map."""
