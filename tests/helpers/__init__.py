"""What several test files share: the float64 oracles, the zoo of user functions, readers of the
pages attnkit writes, the programs that ring and launch tests run as processes, the CUDA case of a
device parameter and the forced backend paths. Tests import them from here, never from conftest."""
