//! vip node agent. `dataplane` is the facade over the XDP program's maps;
//! `maglev` builds the consistent-hashing rings; `model` is the one model of the
//! world, filled by `config` (the YAML file source); `health` probes backends;
//! `k8s` is the Kubernetes source (VipPool resource); `ha` holds VIP ownership, agent heartbeats and gratuitous ARP; `agent` is the
//! run loop that keeps the maps equal to the model; `inspect` decodes the maps for humans.
pub mod addrs;
pub mod agent;
pub mod bgp;
pub mod cleanup;
pub mod cli;
pub mod clock;
pub mod config;
pub mod dataplane;
pub mod ha;
pub mod health;
pub mod http;
pub mod inspect;
pub mod k8s;
pub mod links;
pub mod maglev;
pub mod metrics;
pub mod model;
pub mod neighbour;
pub mod preflight;
pub mod reference;
pub mod route_guard;
pub mod spec;
pub mod status;
