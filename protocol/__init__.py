"""The wire between node agents and the rendezvous server: typed messages (msgspec structs) and the MessagePack
encoders and decoders for each direction. Plain data: nothing in this package does I/O."""
