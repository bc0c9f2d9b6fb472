;;;; zlib.lisp -- raw deflate (RFC 1951) for WebSocket compression
;;;; (permessage-deflate, RFC 7692), from the system's zlib.
;;;;
;;;; The core needs nothing but SBCL: libz.so.1 is opened the first time a
;;;; WebSocket offered compression is accepted with :DEFLATE, and where it
;;;; cannot be opened compression is simply not negotiated.  Every message
;;;; is compressed and inflated on its own (no context takeover either way),
;;;; so a WebSocket holds no zlib state between messages: streams are pooled
;;;; per process and reset after each message (doc/design.md, "WebSocket
;;;; compression").

(in-package #:gallop)

;;; z_stream (zlib.h) on LP64: the fields this file touches.  zlib checks
;;; the size it is given against its own at initialisation.

(defconstant +z-stream-size+ 112)
(defconstant +z-next-in+ 0)
(defconstant +z-avail-in+ 8)
(defconstant +z-next-out+ 24)
(defconstant +z-avail-out+ 32)
(defconstant +z-data-type+ 88)

(defconstant +z-sync-flush+ 2)
(defconstant +z-ok+ 0)
(defconstant +z-stream-end+ 1)
(defconstant +z-buf-error+ -5)

(defconstant +zlib-max-octets+ (expt 2 31)
  "zlib counts a call's input and output in 32 bits: larger messages are
sent uncompressed, and inflate to at most this many octets.")

(defconstant +deflate-level+ 6
  "zlib's default level: doc/design.md, \"WebSocket compression\".")

(sb-ext:defglobal **zlib** nil
  "NIL until zlib is opened, :MISSING when it cannot be, else a vector of
the addresses of the functions below (reset when the image is saved).")

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defparameter *zlib-functions*
    '("zlibVersion" "deflateInit2_" "deflate" "deflateReset" "deflateEnd"
      "inflateInit2_" "inflate" "inflateReset" "inflateEnd")
    "The zlib functions used, in the order of **ZLIB**'s addresses."))

(defun zlib ()
  "The addresses of zlib's functions, opening libz.so.1 the first time; NIL
when it cannot be opened."
  (let ((zlib **zlib**))
    (cond ((vectorp zlib) zlib)
          ((eq zlib :missing) nil)
          (t
           (setf **zlib**
                 (or (ignore-errors
                      (sb-alien:load-shared-object "libz.so.1" :dont-save t)
                      (map 'vector (lambda (name)
                                     (sb-sys:int-sap (or (sb-sys:find-foreign-symbol-address name)
                                                         (error "~A is missing" name))))
                           *zlib-functions*))
                     :missing))
           (zlib)))))

(defun zlib-available-p ()
  "True when zlib can be used (opening it if need be)."
  (and (zlib) t))

(defmacro zcall (name return &rest typed-arguments)
  "Call zlib's NAME with TYPED-ARGUMENTS, (TYPE VALUE)..."
  `(sb-alien:alien-funcall
    (sb-alien:sap-alien (svref **zlib** ,(position name *zlib-functions* :test #'string=))
                        (function ,return ,@(mapcar #'first typed-arguments)))
    ,@(mapcar #'second typed-arguments)))

(defun zlib-version ()
  (unless (zlib)
    (error "zlib (libz.so.1) cannot be opened."))
  (zcall "zlibVersion" sb-alien:c-string))

;;; Streams, pooled per kind and window

(defstruct (zstream (:constructor %make-zstream (sap inflate window)))
  (sap nil :type sb-sys:system-area-pointer)
  (inflate nil)
  (window 15 :type (integer 9 15)))

(defun make-zstream (inflate window)
  "A fresh zlib stream for raw deflate with a window of 2^WINDOW octets."
  (let ((version (zlib-version))       ; opens zlib
        (sap (sb-alien:alien-sap (sb-alien:make-alien (sb-alien:unsigned 8) +z-stream-size+))))
    (dotimes (i (/ +z-stream-size+ 8)) (setf (sb-sys:sap-ref-64 sap (* 8 i)) 0))
    (let ((result (if inflate
                      (zcall "inflateInit2_" sb-alien:int (sb-sys:system-area-pointer sap)
                             (sb-alien:int (- window)) (sb-alien:c-string version)
                             (sb-alien:int +z-stream-size+))
                      (zcall "deflateInit2_" sb-alien:int (sb-sys:system-area-pointer sap)
                             (sb-alien:int +deflate-level+) (sb-alien:int 8) ; Z_DEFLATED
                             (sb-alien:int (- window)) (sb-alien:int 8) ; memLevel
                             (sb-alien:int 0)                            ; Z_DEFAULT_STRATEGY
                             (sb-alien:c-string version)
                             (sb-alien:int +z-stream-size+)))))
      (unless (= result +z-ok+)
        (sb-alien:free-alien (sb-alien:sap-alien sap (* (sb-alien:unsigned 8))))
        (error "zlib refused a stream (~D)" result))
      (%make-zstream sap inflate window))))

(defun free-zstream (z)
  (let ((sap (zstream-sap z)))
    (if (zstream-inflate z)
        (zcall "inflateEnd" sb-alien:int (sb-sys:system-area-pointer sap))
        (zcall "deflateEnd" sb-alien:int (sb-sys:system-area-pointer sap)))
    (sb-alien:free-alien (sb-alien:sap-alien sap (* (sb-alien:unsigned 8))))))

(defconstant +zstreams-kept+ 8
  "Streams of one kind and window the pool keeps; more, made when that many
threads compress at once, are freed after use.")

(sb-ext:defglobal **zstreams** (make-array 32 :initial-element nil)
  "Free streams: a list per kind (inflate: +16) and window.")
(sb-ext:defglobal **zstreams-lock** (sb-thread:make-mutex :name "zlib streams"))

(defun take-zstream (inflate window)
  (let ((i (+ window (if inflate 16 0))))
    (or (sb-thread:with-mutex (**zstreams-lock**)
          (pop (svref **zstreams** i)))
        (make-zstream inflate window))))

(defun give-zstream (z)
  "Reset Z for the next message and give it back to the pool."
  (let ((sap (zstream-sap z)))
    (if (zstream-inflate z)
        (zcall "inflateReset" sb-alien:int (sb-sys:system-area-pointer sap))
        (zcall "deflateReset" sb-alien:int (sb-sys:system-area-pointer sap))))
  (let ((i (+ (zstream-window z) (if (zstream-inflate z) 16 0))))
    (unless (sb-thread:with-mutex (**zstreams-lock**)
              (when (< (length (svref **zstreams** i)) +zstreams-kept+)
                (push z (svref **zstreams** i))))
      (free-zstream z))))

(defun forget-zlib ()
  "Before the image is saved: free the pooled streams and forget zlib's
addresses, which a restarted image opens afresh."
  (when (vectorp **zlib**)
    (sb-thread:with-mutex (**zstreams-lock**)
      (dotimes (i (length **zstreams**))
        (mapc #'free-zstream (shiftf (svref **zstreams** i) nil)))))
  (setf **zlib** nil))

(pushnew 'forget-zlib sb-ext:*save-hooks*)

(defmacro with-zstream ((z inflate window) &body body)
  `(let ((,z (take-zstream ,inflate ,window)))
     (unwind-protect (progn ,@body) (give-zstream ,z))))

(defun zstream-run (z octets start end out out-start out-end)
  "Run Z on OCTETS[START,END) into OUT[OUT-START,OUT-END) with a sync flush:
zlib's result, the octets of input left and of output space left."
  (declare (type octets octets out) (type fixnum start end out-start out-end))
  (let ((sap (zstream-sap z)))
    (sb-sys:with-pinned-objects (octets out)
      (setf (sb-sys:sap-ref-sap sap +z-next-in+) (sb-sys:sap+ (sb-sys:vector-sap octets) start)
            (sb-sys:sap-ref-32 sap +z-avail-in+) (- end start)
            (sb-sys:sap-ref-sap sap +z-next-out+) (sb-sys:sap+ (sb-sys:vector-sap out) out-start)
            (sb-sys:sap-ref-32 sap +z-avail-out+) (- out-end out-start))
      (let ((result (if (zstream-inflate z)
                        (zcall "inflate" sb-alien:int (sb-sys:system-area-pointer sap)
                               (sb-alien:int +z-sync-flush+))
                        (zcall "deflate" sb-alien:int (sb-sys:system-area-pointer sap)
                               (sb-alien:int +z-sync-flush+)))))
        (values result (sb-sys:sap-ref-32 sap +z-avail-in+) (sb-sys:sap-ref-32 sap +z-avail-out+))))))

;;; A message

(defun deflate-message (octets window)
  "OCTETS compressed as one message (RFC 7692, 7.2.1): the raw deflate with
a sync flush, its final 00 00 FF FF left out, as (values BUFFER LENGTH); NIL
when that is not shorter than OCTETS.  WINDOW: the window's bits."
  (declare (type octets octets))
  (when (>= (length octets) +zlib-max-octets+) ; sent as it is
    (return-from deflate-message nil))
  (let* ((n (length octets))
         (out (make-array (+ n 4) :element-type '(unsigned-byte 8))))
    (with-zstream (z nil window)
      (multiple-value-bind (result in-left out-left) (zstream-run z octets 0 n out 0 (+ n 4))
        ;; Output space left after a sync flush means all of it is out.
        (when (and (= result +z-ok+) (zerop in-left) (plusp out-left))
          (let ((length (- (+ n 4) out-left 4)))
            (when (and (< length n) (>= length 0)
                       (= 0 (aref out length) (aref out (+ length 1)))
                       (= #xFF (aref out (+ length 2)) (aref out (+ length 3))))
              (values out length))))))))

(defun inflate-message (octets end limit charge)
  "Inflate OCTETS[0,END), a message's compressed payload followed by 00 00
FF FF (RFC 7692, 7.2.2; an empty payload is an empty message), into a
buffer grown as output comes, up to LIMIT octets; CHARGE (DELTA) is called
as the buffer grows and answers whether that much more memory may be used.  Returns (values BUFFER LENGTH), or
:INVALID (not deflate data, data that stops inside a block or goes on
after its final one), :TOO-BIG or :NO-MEMORY."
  (declare (type octets octets) (type fixnum end limit))
  (when (= end 4)
    (return-from inflate-message (values (make-array 0 :element-type '(unsigned-byte 8)) 0)))
  (when (>= end +zlib-max-octets+)
    (return-from inflate-message :too-big))
  (let* ((limit (min limit (1- +zlib-max-octets+)))
         (size (min (1+ limit) (max 4096 (* 4 end))))
         (out (make-array 0 :element-type '(unsigned-byte 8)))
         (start 0)
         (fill 0))
    (declare (type fixnum size start fill))
    (flet ((grow (to)
             ;; Counted once made: a failure to make it leaves nothing counted.
             (let ((bigger (make-array to :element-type '(unsigned-byte 8))))
               (unless (funcall charge (- to (length out)))
                 (return-from inflate-message :no-memory))
               (replace bigger out :end2 fill)
               (setf out bigger))))
      (grow size)
      (with-zstream (z t 15)
        (loop
          (multiple-value-bind (result in-left out-left)
              (zstream-run z octets start end out fill (length out))
            (setf start (- end in-left)
                  fill (- (length out) out-left))
            (cond ((= result +z-stream-end+)
                   ;; The final block: only the 00 00 FF FF appended may follow.
                   (if (= in-left 4)
                       (return)
                       (return-from inflate-message :invalid)))
                  ((and (minusp result) (/= result +z-buf-error+))
                   (return-from inflate-message :invalid))
                  ((and (zerop in-left)
                        (logbitp 7 (sb-sys:sap-ref-32 (zstream-sap z) +z-data-type+)))
                   ;; All in, and between blocks (zlib pulls octets only as
                   ;; it needs them, so the empty block appended was read).
                   (return))
                  ((plusp out-left)
                   ;; Room left, and the data stops inside a block.
                   (return-from inflate-message :invalid))
                  ((> fill limit)
                   (return-from inflate-message :too-big))
                  (t (grow (min (1+ limit) (* 2 (length out))))))))))
    (if (> fill limit)
        :too-big
        (values out fill))))
