//! `vgpu watch`: `status` refreshed in place.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use crate::Failure;
use crate::cli::WatchArgs;
use crate::report::{read, table_path};
use crate::signals;

/// Clear the screen and home the cursor.
const CLEAR: &str = "\x1b[H\x1b[2J";

/// `vgpu watch`: until Ctrl-C on a terminal; `--count` refreshes (1 by default when stdout is
/// not a terminal, so a pipe or a test never runs forever by accident).
pub fn watch(args: &WatchArgs) -> Result<ExitCode, Failure> {
    let path = table_path(&args.cache, &args.share);
    let tty = std::io::stdout().is_terminal();
    let count = args.count.unwrap_or(if tty { 0 } else { 1 });
    signals::install_stop_handler();
    let mut out = std::io::stdout();
    let mut frame = 0u64;
    loop {
        frame += 1;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let body = match read(&path) {
            Ok(report) => report.render_text(),
            // A file that disappears or is not created yet is worth watching for, not fatal.
            Err(e) => format!("vgpu status: {}\n\n{e}\n", path.display()),
        };
        let header = format!(
            "every {:?}, refresh {frame}, unix time {now}; Ctrl-C to stop\n",
            args.interval
        );
        let text = if tty {
            format!("{CLEAR}{header}{body}")
        } else {
            format!("{header}{body}\n")
        };
        // A closed pipe ends the watch quietly.
        if out
            .write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            return Ok(ExitCode::SUCCESS);
        }
        if (count != 0 && frame >= count) || !signals::sleep_unless_stopped(args.interval) {
            return Ok(ExitCode::SUCCESS);
        }
    }
}
