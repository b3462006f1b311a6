"""Pure Python, no torch: the engine's data structures and decisions (config, requests and
their sampling parameters, the schedulers and their policies, the block manager and prefix
cache, swap decisions, stats). Everything above it may import it; it imports nothing of the
package but itself."""
