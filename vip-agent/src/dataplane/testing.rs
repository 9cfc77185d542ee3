//! Running the object's programs on frames (BPF_PROG_TEST_RUN): the fixtures'
//! and benchmarks' way in, apart from the facade the agent uses.
use std::time::Duration;

use anyhow::{anyhow, Result};
use aya::programs::{TestRun, TestRunOptions, Xdp};

use super::{Dataplane, DataplaneError};
use vip_common::PROGRAM_NAME;

impl Dataplane {
    /// Runs the program once (or `repeat` times) on `frame` with BPF_PROG_TEST_RUN.
    /// Returns the verdict, the output frame and the mean duration per run.
    /// `live_batch`: run in live-frames mode (frames really go out), batch size.
    pub fn test_run(&mut self, frame: &[u8], repeat: u32, live_batch: Option<u32>) -> Result<(u32, Vec<u8>, Duration)> {
        self.test_run_program(PROGRAM_NAME, frame, repeat, live_batch)
    }

    /// [`Self::test_run`] for any XDP program of the object (loaded on first use),
    /// e.g. the benchmark's `xdp_baseline_pass`.
    pub fn test_run_program(&mut self, name: &str, frame: &[u8], repeat: u32, live_batch: Option<u32>) -> Result<(u32, Vec<u8>, Duration)> {
        let mut out = vec![0u8; frame.len() + 256];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.repeat = repeat.max(1);
        if let Some(batch) = live_batch {
            opts.attrs = aya::programs::TestRunAttrs::new().xdp_live_frames(batch);
        } else {
            opts.data_out = Some(&mut out);
        }
        let ebpf = self.ebpf.as_mut().ok_or(DataplaneError::NotLoaded)?;
        let prog: &mut Xdp = ebpf.program_mut(name).ok_or_else(|| anyhow!("no program {name} in the object"))?.try_into()?;
        if prog.fd().is_err() {
            prog.load()?;
        }
        let r = prog.test_run(opts)?;
        out.truncate(r.data_size_out as usize);
        Ok((r.return_value, out, r.duration))
    }
}
