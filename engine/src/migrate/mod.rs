//! Moving to kiln from another server: its launch, as written, becomes a kiln configuration.

pub mod sglang;
