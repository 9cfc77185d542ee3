//! What the data path's facade reports when a service cannot be programmed, typed
//! so that callers can tell a full table (wait for room, tell the user) from a
//! map operation the kernel refused.
use crate::maglev::MaglevError;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DataplaneError {
    #[error("lb4_ring is full: no room for a {len}-slot ring in {capacity} slots (raise --ring-capacity)")]
    RingFull { len: u32, capacity: u32 },
    #[error("ring region {offset}+{len} lies outside lb4_ring ({capacity} slots)")]
    RingOutside { offset: u32, len: u32, capacity: u32 },
    #[error("all {0} service ids are in use")]
    ServiceIdsExhausted(u32),
    #[error("all {0} backend ids are in use")]
    BackendIdsExhausted(u32),
    #[error(transparent)]
    Ring(#[from] MaglevError),
    #[error("the XDP object was not loaded by this process")]
    NotLoaded,
    /// A map operation the kernel refused (kept as text: one failure is shared by
    /// every service of a batch that hit it).
    #[error("writing {map}: {message}")]
    Kernel { map: &'static str, message: String },
}

impl DataplaneError {
    pub fn kernel(map: &'static str, e: impl std::fmt::Display) -> Self {
        Self::Kernel { map, message: e.to_string() }
    }

    /// A table is full: the service fits once others go or the table grows.
    pub fn is_capacity(&self) -> bool {
        matches!(self, Self::RingFull { .. } | Self::ServiceIdsExhausted(_) | Self::BackendIdsExhausted(_))
    }
}
