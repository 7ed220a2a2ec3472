//! Output tok/s and TTFT (p50) against concurrency, one line per config, as PNG and SVG. The font
//! is compiled in (Noto Sans), so the plot needs no fonts installed on the machine.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::run::BenchResult;

fn register_font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, ttf_noto_sans::REGULAR)
            .map_err(|_| "the embedded font did not load".to_string())
    })
    .clone()
}

/// Writes `stem.png` and `stem.svg`.
pub fn write(runs: &[BenchResult], stem: &Path) -> Result<(), String> {
    register_font()?;
    let png = std::path::PathBuf::from(format!("{}.png", stem.display()));
    let svg = std::path::PathBuf::from(format!("{}.svg", stem.display()));
    {
        let root = BitMapBackend::new(&png, (1200, 500)).into_drawing_area();
        draw(&root, runs).map_err(|e| format!("{}: {e}", png.display()))?;
        root.present()
            .map_err(|e| format!("{}: {e}", png.display()))?;
    }
    let root = SVGBackend::new(&svg, (1200, 500)).into_drawing_area();
    draw(&root, runs).map_err(|e| format!("{}: {e}", svg.display()))?;
    root.present()
        .map_err(|e| format!("{}: {e}", svg.display()))?;
    Ok(())
}

type DrawResult<B> = Result<(), DrawingAreaErrorKind<<B as DrawingBackend>::ErrorType>>;

fn draw<B: DrawingBackend>(root: &DrawingArea<B, Shift>, runs: &[BenchResult]) -> DrawResult<B> {
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    let tok = |l: &super::LevelResult| l.output_tok_s;
    let ttft = |l: &super::LevelResult| l.ttft_ms.p50;
    panel(&panels[0], runs, "Output tokens/s", "output tok/s", &tok)?;
    panel(
        &panels[1],
        runs,
        "Time to first token (p50)",
        "TTFT ms",
        &ttft,
    )?;
    Ok(())
}

fn panel<B: DrawingBackend>(
    area: &DrawingArea<B, Shift>,
    runs: &[BenchResult],
    title: &str,
    y_desc: &str,
    value: &dyn Fn(&super::LevelResult) -> f64,
) -> DrawResult<B> {
    let levels = runs.iter().flat_map(|r| r.levels.iter());
    let max_c = levels
        .clone()
        .map(|l| l.concurrency)
        .max()
        .unwrap_or(1)
        .max(2) as f64;
    let max_y = levels.map(value).fold(0.0f64, f64::max).max(1.0) * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((1.0f64..max_c * 1.2).log_scale(), 0.0f64..max_y)?;
    chart
        .configure_mesh()
        .x_desc("concurrency")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()?;
    for (i, r) in runs.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(f64, f64)> = r
            .levels
            .iter()
            .map(|l| (l.concurrency as f64, value(l)))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(r.label.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 4, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()?;
    Ok(())
}
