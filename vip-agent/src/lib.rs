//! vip node agent. `dataplane` is the facade over the XDP program's maps;
//! `maglev` builds the consistent-hashing rings; `inspect` decodes the maps for humans.
pub mod dataplane;
pub mod inspect;
pub mod maglev;
