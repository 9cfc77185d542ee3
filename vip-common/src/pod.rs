//! `aya::Pod` for every layout the agent reads or writes through aya (the `user` feature).

use crate::*;

// SAFETY: all of these are repr(C), Copy, with explicit padding and no pointers.
unsafe impl aya::Pod for LbIface {}
unsafe impl aya::Pod for ArpHeldKey {}
unsafe impl aya::Pod for NdpHeldKey {}
unsafe impl aya::Pod for LbVlanKey {}
unsafe impl aya::Pod for LbHome {}
unsafe impl aya::Pod for HeldVip {}
unsafe impl aya::Pod for Lb4HeldSlot {}
unsafe impl aya::Pod for Lb6HeldSlot {}
unsafe impl aya::Pod for ArpWatch {}
unsafe impl aya::Pod for Lb4ServiceKey {}
unsafe impl aya::Pod for LbService {}
unsafe impl aya::Pod for LbBackend {}
unsafe impl aya::Pod for Lb4FlowKey {}
unsafe impl aya::Pod for LbFlowSet {}
unsafe impl aya::Pod for LbFlowsCtl {}
unsafe impl aya::Pod for Lb4FirstPacket {}
unsafe impl aya::Pod for Counter {}
unsafe impl aya::Pod for Lb4FlowCacheEntry {}
unsafe impl aya::Pod for FlowCacheCtl {}
unsafe impl aya::Pod for Lb6ServiceKey {}
unsafe impl aya::Pod for Lb6FlowKey {}
unsafe impl aya::Pod for Lb6FirstPacket {}
unsafe impl aya::Pod for Lb6FlowCacheEntry {}
