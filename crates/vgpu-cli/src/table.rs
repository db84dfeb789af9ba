//! The adapter between vgpu-shm's `UsageTable` and the CLI's report model.

use std::path::Path;

use crate::report::StatusReport;

/// Read a usage file into a report.
pub fn read_report(path: &Path) -> Result<StatusReport, String> {
    Err(format!(
        "{}: reading usage files is not implemented yet",
        path.display()
    ))
}
