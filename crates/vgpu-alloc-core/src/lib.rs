#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod ledger;

pub use ledger::{
    DeviceIndex, DeviceUsage, InMemoryLedger, OutOfMemory, Reservation, UsageClass, UsageLedger,
    MAX_DEVICES,
};
