//! vip node agent. `dataplane` is the facade over the XDP program's maps;
//! `maglev` builds the consistent-hashing rings; `inspect` decodes the maps for humans;
//! `ha` holds VIP ownership, agent heartbeats and gratuitous ARP.
pub mod dataplane;
pub mod ha;
pub mod inspect;
pub mod maglev;
