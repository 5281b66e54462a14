"""The peer tier's network side: agents of a pool read each other's chunks over TCP.

`wire` holds the frames, `auth` the pool-secret handshake, `directory` who holds what,
`server` what an agent serves its peers, `links` what it reads from them, and `network`
ties them to the agent's spaces. The store uses them through `tiers.peer.PeerTier`, like
any other tier (docs/cross-node.md).
"""
