//! The Kubernetes source: the VipPool resource and (next) the watchers, the
//! elected allocator and the status writers that fill the same model as the file.
pub mod allocate;
pub mod controller;
pub mod crd;
pub mod leader;
pub mod pools;
pub mod source;
