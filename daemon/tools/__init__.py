"""The ``kvswap`` operator tools (:mod:`.admin` is the command group): demo, bench, status,
launch, keygen and the offline storage commands. The daemon's runtime never imports this
package; the tools reach a daemon through its wire protocol or its storage directory."""
