! The seed author's design, as a precision-lab command candidate (docs/external.md).
!
! One forward and backward of the 3-layer CNN (Conv 1->16, ReLU, Conv 16->16, ReLU, Conv 16->1;
! 3x3 kernels, stride 1, padding 1, bias; MSE loss, mean). Weights are stored (H, W, In, Out);
! the weight gradient is computed as cuDNN returns it, (Out, In, H, W), and converted back.
!
! Usage: cnn REQUEST_DIR RESPONSE_DIR
!   reads  REQUEST_DIR/bundle.json and the raw column-major binaries it lists ("order": "F"),
!   writes RESPONSE_DIR/bundle.json and RESPONSE_DIR/<name>.bin (the directory must exist).
!
! Build (see Makefile): one source, three switches of the preprocessor (-cpp):
!   -DDOUBLE_PRECISION  real(8) everywhere: the seed's "recompile in double precision"
!   -DFLIP_SLIP         reintroduces the conversion slip (one line in cudnn_to_hwio)
module precision_kind
  use, intrinsic :: iso_fortran_env, only: real32, real64
  implicit none
#ifdef DOUBLE_PRECISION
  integer, parameter :: wp = real64
  character(len=*), parameter :: precision_name = "float64"
#else
  integer, parameter :: wp = real32
  character(len=*), parameter :: precision_name = "float32"
#endif
end module precision_kind

module bundle_io
  use precision_kind
  use, intrinsic :: iso_fortran_env, only: error_unit
  implicit none
contains

  subroutine fail(message)
    character(len=*), intent(in) :: message
    write (error_unit, '(a)') "cnn: " // message
    error stop 1
  end subroutine fail

  function read_text(path) result(text)
    character(len=*), intent(in) :: path
    character(len=:), allocatable :: text
    integer :: unit, size, status
    open (newunit=unit, file=path, access="stream", form="unformatted", status="old", iostat=status)
    if (status /= 0) call fail("cannot open " // path)
    inquire (unit=unit, size=size)
    allocate (character(len=size) :: text)
    read (unit) text
    close (unit)
  end function read_text

  ! The value of `"field": …` inside the entry `"name": {…}` of the manifest's "arrays" map.
  ! A substring search, not a JSON parser: it relies on the lab writing one array per line, lists inline.
  function entry_field(manifest, name, field) result(value)
    character(len=*), intent(in) :: manifest, name, field
    character(len=:), allocatable :: value
    integer :: start, first, last
    start = index(manifest, '"' // name // '": {')
    if (start == 0) call fail("request bundle.json lists no array " // name)
    first = start + index(manifest(start:), '"' // field // '": ') + len(field) + 3
    if (manifest(first:first) == '"') then
      last = first + index(manifest(first + 1:), '"')
      value = manifest(first + 1:last - 1)
    else
      last = first + index(manifest(first:), ']') - 1
      value = manifest(first:last)
    end if
  end function entry_field

  subroutine expect(manifest, text)
    character(len=*), intent(in) :: manifest, text
    if (index(manifest, text) == 0) call fail("request bundle.json lacks " // text // &
                                              " (this build reads " // precision_name // ", HWIO, order F)")
  end subroutine expect

  subroutine read_raw(directory, manifest, name, values)
    character(len=*), intent(in) :: directory, manifest, name
    real(wp), intent(out) :: values(*)
    integer :: unit, status, count
    count = size_of(entry_field(manifest, name, "shape"))
    open (newunit=unit, file=directory // "/" // entry_field(manifest, name, "file"), access="stream", &
          form="unformatted", status="old", iostat=status)
    if (status /= 0) call fail("cannot open the file of " // name)
    read (unit, iostat=status) values(1:count)
    if (status /= 0) call fail("short file for " // name)
    close (unit)
  end subroutine read_raw

  integer function size_of(shape_text)
    character(len=*), intent(in) :: shape_text
    integer :: dims(8), rank, j
    dims = 1
    rank = count([(shape_text(j:j) == ',', j = 1, len(shape_text))]) + 1
    if (len_trim(shape_text) <= 2) rank = 0
    if (rank > 0) read (shape_text(2:len(shape_text) - 1), *) dims(1:rank)
    size_of = product(dims(1:max(rank, 1)))
    if (rank == 0) size_of = 1
  end function size_of

  function int_text(value) result(text)
    integer, intent(in) :: value
    character(len=:), allocatable :: text
    character(len=24) :: buffer
    write (buffer, '(i0)') value
    text = trim(buffer)
  end function int_text

  subroutine write_raw(directory, name, values, count)
    character(len=*), intent(in) :: directory, name
    real(wp), intent(in) :: values(*)
    integer, intent(in) :: count
    integer :: unit, status
    open (newunit=unit, file=directory // "/" // name // ".bin", access="stream", form="unformatted", &
          status="replace", iostat=status)
    if (status /= 0) call fail("cannot write " // directory // "/" // name // ".bin")
    write (unit) values(1:count)
    close (unit)
  end subroutine write_raw

  function array_entry(name, shape_text) result(text)
    character(len=*), intent(in) :: name, shape_text
    character(len=:), allocatable :: text
    text = '"' // name // '": {"file": "' // name // '.bin", "dtype": "' // precision_name // &
           '", "shape": ' // shape_text // ', "order": "F"}'
  end function array_entry
end module bundle_io

module seed_cnn
  use precision_kind
  implicit none
  integer, parameter :: channels(4) = [1, 16, 16, 1]

  type :: layer
    real(wp), allocatable :: weight(:, :, :, :)       ! (H, W, In, Out): the seed's storage
    real(wp), allocatable :: bias(:)
    real(wp), allocatable :: weight_grad(:, :, :, :)  ! (H, W, In, Out)
    real(wp), allocatable :: bias_grad(:)
  end type layer

  type :: plane_stack
    real(wp), allocatable :: v(:, :, :, :)            ! (x, y, channel, sample), x fastest
  end type plane_stack
contains

  ! z(x, y, o, n) = b(o) + sum_{i, kh, kw} w(kh, kw, i, o) a(x + kw - 2, y + kh - 2, i, n)  (a zero-padded)
  subroutine conv_forward(a, l, z)
    real(wp), intent(in) :: a(0:, 0:, :, :)
    type(layer), intent(in) :: l
    real(wp), intent(out) :: z(:, :, :, :)
    integer :: w, h, n, y, o, i, kh, kw
    w = size(z, 1); h = size(z, 2)
    do n = 1, size(z, 4)
      do y = 1, h
        do o = 1, size(z, 3)
          z(:, y, o, n) = l%bias(o)
          do i = 1, size(a, 3)
            do kh = 1, 3
              do kw = 1, 3
                z(:, y, o, n) = z(:, y, o, n) + l%weight(kh, kw, i, o) * a(kw - 1:w + kw - 2, y + kh - 2, i, n)
              end do
            end do
          end do
        end do
      end do
    end do
  end subroutine conv_forward

  ! The weight gradient as cuDNN returns it, (Out, In, H, W): per column x, sum over rows; then over x.
  subroutine conv_weight_grad(a, g, grad_cudnn)
    real(wp), intent(in) :: a(0:, 0:, :, :), g(:, :, :, :)
    real(wp), intent(out) :: grad_cudnn(:, :, :, :)
    real(wp), allocatable :: column_sums(:, :, :)
    integer :: w, h, n, y, o, i, kh, kw
    w = size(g, 1); h = size(g, 2)
    allocate (column_sums(w, 3, 3))
    do o = 1, size(g, 3)
      do i = 1, size(a, 3)
        column_sums = 0
        do n = 1, size(g, 4)
          do y = 1, h
            do kw = 1, 3
              do kh = 1, 3
                column_sums(:, kh, kw) = column_sums(:, kh, kw) + a(kw - 1:w + kw - 2, y + kh - 2, i, n) * g(:, y, o, n)
              end do
            end do
          end do
        end do
        do kw = 1, 3
          do kh = 1, 3
            grad_cudnn(o, i, kh, kw) = sum(column_sums(:, kh, kw))
          end do
        end do
      end do
    end do
  end subroutine conv_weight_grad

  ! (Out, In, H, W) -> (H, W, In, Out): cuDNN computes a cross-correlation, so a pure transpose.
  subroutine cudnn_to_hwio(grad_cudnn, grad)
    real(wp), intent(in) :: grad_cudnn(:, :, :, :)
    real(wp), intent(out) :: grad(:, :, :, :)
    integer :: o, i, kh, kw
    do o = 1, size(grad, 4)
      do i = 1, size(grad, 3)
        do kw = 1, 3
          do kh = 1, 3
#ifdef FLIP_SLIP
            grad(kh, kw, i, o) = grad_cudnn(o, i, 4 - kh, 4 - kw)
#else
            grad(kh, kw, i, o) = grad_cudnn(o, i, kh, kw)
#endif
          end do
        end do
      end do
    end do
  end subroutine cudnn_to_hwio

  ! da(x, y, i, n) = [z_prev > 0] * sum_{o, kh, kw} w(kh, kw, i, o) g(x - kw + 2, y - kh + 2, o, n)  (g zero-padded)
  subroutine conv_input_grad(g, l, z_prev, da)
    real(wp), intent(in) :: g(0:, 0:, :, :), z_prev(:, :, :, :)
    type(layer), intent(in) :: l
    real(wp), intent(out) :: da(:, :, :, :)
    integer :: w, h, n, y, o, i, kh, kw
    w = size(da, 1); h = size(da, 2)
    do n = 1, size(da, 4)
      do y = 1, h
        do i = 1, size(da, 3)
          da(:, y, i, n) = 0
          do o = 1, size(g, 3)
            do kh = 1, 3
              do kw = 1, 3
                da(:, y, i, n) = da(:, y, i, n) + l%weight(kh, kw, i, o) * g(3 - kw:w + 2 - kw, y - kh + 2, o, n)
              end do
            end do
          end do
          where (z_prev(:, y, i, n) <= 0) da(:, y, i, n) = 0
        end do
      end do
    end do
  end subroutine conv_input_grad

  subroutine bias_grad(g, grad)
    real(wp), intent(in) :: g(:, :, :, :)
    real(wp), intent(out) :: grad(:)
    integer :: o, n, y
    do o = 1, size(g, 3)
      grad(o) = 0
      do n = 1, size(g, 4)
        do y = 1, size(g, 2)
          grad(o) = grad(o) + sum(g(:, y, o, n))
        end do
      end do
    end do
  end subroutine bias_grad
end module seed_cnn

program cnn
  use precision_kind
  use bundle_io
  use seed_cnn
  implicit none
  character(len=4096) :: request, response
  character(len=:), allocatable :: manifest, json, shape_text
  type(layer) :: layers(3)
  type(plane_stack) :: acts(0:2), pres(3)
  real(wp), allocatable :: input(:, :, :, :), target(:, :, :, :), g(:, :, :, :), out(:, :, :, :), grad_cudnn(:, :, :, :)
  real(wp) :: loss
  integer :: dims(4), n, h, w, k, x, y, s, cin, cout

  if (command_argument_count() /= 2) call fail("usage: cnn REQUEST_DIR RESPONSE_DIR")
  call get_command_argument(1, request)
  call get_command_argument(2, response)
  manifest = read_text(trim(request) // "/bundle.json")
  call expect(manifest, '"precision": "' // precision_name // '"')
  call expect(manifest, '"weight_layout": "HWIO"')
  shape_text = entry_field(manifest, "input", "shape")
  read (shape_text(2:len(shape_text) - 1), *) dims
  n = dims(1); h = dims(3); w = dims(4)

  ! the request's (N, C, H, W) arrays, column-major, into (x, y, channel, sample) planes
  allocate (input(n, 1, h, w), target(n, 1, h, w))
  call read_raw(trim(request), manifest, "input", input)
  call read_raw(trim(request), manifest, "target", target)
  allocate (acts(0)%v(0:w + 1, 0:h + 1, 1, n), source=0.0_wp)
  do s = 1, n
    do y = 1, h
      do x = 1, w
        acts(0)%v(x, y, 1, s) = input(s, 1, y, x)
      end do
    end do
  end do
  do k = 1, 3
    cin = channels(k); cout = channels(k + 1)
    allocate (layers(k)%weight(3, 3, cin, cout), layers(k)%bias(cout))
    allocate (layers(k)%weight_grad(3, 3, cin, cout), layers(k)%bias_grad(cout))
    call read_raw(trim(request), manifest, "conv" // int_text(k) // ".weight", layers(k)%weight)
    call read_raw(trim(request), manifest, "conv" // int_text(k) // ".bias", layers(k)%bias)
  end do

  ! forward
  do k = 1, 3
    allocate (pres(k)%v(w, h, channels(k + 1), n))
    call conv_forward(acts(k - 1)%v, layers(k), pres(k)%v)
    if (k < 3) then
      allocate (acts(k)%v(0:w + 1, 0:h + 1, channels(k + 1), n), source=0.0_wp)
      acts(k)%v(1:w, 1:h, :, :) = max(pres(k)%v, 0.0_wp)
    end if
  end do

  ! MSE loss and its gradient d mean((y - t)^2) / dy = 2 (y - t) / count, into a zero-padded plane
  allocate (g(0:w + 1, 0:h + 1, 1, n), source=0.0_wp)
  loss = 0
  do s = 1, n
    do y = 1, h
      do x = 1, w
        g(x, y, 1, s) = pres(3)%v(x, y, 1, s) - target(s, 1, y, x)
      end do
      loss = loss + dot_product(g(1:w, y, 1, s), g(1:w, y, 1, s))
    end do
  end do
  loss = loss / real(n * h * w, wp)
  g = g * (2.0_wp / real(n * h * w, wp))

  ! backward
  do k = 3, 1, -1
    allocate (grad_cudnn(channels(k + 1), channels(k), 3, 3))
    call conv_weight_grad(acts(k - 1)%v, g(1:w, 1:h, :, :), grad_cudnn)
    call cudnn_to_hwio(grad_cudnn, layers(k)%weight_grad)
    deallocate (grad_cudnn)
    call bias_grad(g(1:w, 1:h, :, :), layers(k)%bias_grad)
    if (k > 1) then
      block
        real(wp), allocatable :: da(:, :, :, :)
        allocate (da(w, h, channels(k), n))
        call conv_input_grad(g, layers(k), pres(k - 1)%v, da)
        deallocate (g)
        allocate (g(0:w + 1, 0:h + 1, channels(k), n), source=0.0_wp)
        g(1:w, 1:h, :, :) = da
      end block
    end if
  end do

  ! response: raw column-major binaries in the request's layouts, and their manifest
  allocate (out(n, 1, h, w))
  do s = 1, n
    do y = 1, h
      do x = 1, w
        out(s, 1, y, x) = pres(3)%v(x, y, 1, s)
      end do
    end do
  end do
  call write_raw(trim(response), "loss", [loss], 1)
  call write_raw(trim(response), "output", out, size(out))
  json = '{"format": "precision-lab/bundle-1", "kind": "response", "precision": "' // precision_name // &
         '", "weight_layout": "HWIO", "arrays": {' // array_entry("loss", "[]") // ', ' // &
         array_entry("output", "[" // int_text(n) // ", 1, " // int_text(h) // ", " // int_text(w) // "]")
  do k = 1, 3
    cin = channels(k); cout = channels(k + 1)
    call write_raw(trim(response), "conv" // int_text(k) // ".weight.grad", layers(k)%weight_grad, 9 * cin * cout)
    call write_raw(trim(response), "conv" // int_text(k) // ".bias.grad", layers(k)%bias_grad, cout)
    json = json // ', ' // array_entry("conv" // int_text(k) // ".weight.grad", &
                                       "[3, 3, " // int_text(cin) // ", " // int_text(cout) // "]") // &
           ', ' // array_entry("conv" // int_text(k) // ".bias.grad", "[" // int_text(cout) // "]")
  end do
  json = json // '}}'
  block
    integer :: unit
    open (newunit=unit, file=trim(response) // "/bundle.json", status="replace", action="write")
    write (unit, '(a)') json
    close (unit)
  end block
end program cnn
