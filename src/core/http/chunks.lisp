;;;; chunks.lisp -- the chunked transfer coding of request bodies (RFC 9112,
;;;; section 7.1), decoded in place.
;;;;
;;;; A CHUNK-DECODER is a state machine over the octets of a chunked body.
;;;; CHUNK-DECODER-STEP consumes framing octets (size lines, extensions, the
;;;; CRLF after data, trailer fields) and stops at the first data octet, so
;;;; the caller takes data straight from its own buffer (CHUNK-DECODER-TAKE):
;;;; the body is never copied to be decoded.  It follows the grammar exactly:
;;;;
;;;;   chunked-body = *chunk last-chunk trailer-section CRLF
;;;;   chunk        = chunk-size [ chunk-ext ] CRLF chunk-data CRLF
;;;;   chunk-ext    = *( BWS ";" BWS ext-name [ BWS "=" BWS ext-val ] )
;;;;   ext-name     = token            ext-val = token / quoted-string
;;;;   trailer-section = *( field-line CRLF )
;;;;
;;;; so white space after a size with no extension, an empty extension name,
;;;; an unbalanced quote, a bare LF or CR, or a malformed trailer line are
;;;; refused with REQUEST-BODY-ERROR 400, and data past the decoder's MAX
;;;; octets with 413.
;;;;
;;;; States (slot STATE), and what each accepts:
;;;;   :SIZE           the first hex digit of a chunk size
;;;;   :SIZE-MORE      more hex digits; SP/HTAB -> :BWS-SEMI; ";" -> :BWS-NAME; CR
;;;;   :BWS-SEMI       SP/HTAB; ";" -> :BWS-NAME (white space must lead to ";")
;;;;   :BWS-NAME       SP/HTAB; a token octet -> :EXT-NAME
;;;;   :EXT-NAME       token octets; SP/HTAB -> :BWS-EQUALS; "=" -> :BWS-VALUE; ";"; CR
;;;;   :BWS-EQUALS     SP/HTAB; "=" -> :BWS-VALUE; ";" -> :BWS-NAME
;;;;   :BWS-VALUE      SP/HTAB; a token octet -> :EXT-TOKEN; DQUOTE -> :QUOTED
;;;;   :EXT-TOKEN      token octets; SP/HTAB -> :BWS-SEMI; ";"; CR
;;;;   :QUOTED         qdtext; "\" -> :QUOTED-PAIR; DQUOTE -> :AFTER-QUOTED
;;;;   :QUOTED-PAIR    HTAB, SP, VCHAR or obs-text -> :QUOTED
;;;;   :AFTER-QUOTED   SP/HTAB -> :BWS-SEMI; ";" -> :BWS-NAME; CR
;;;;   :SIZE-LF        the LF ending a size line -> :DATA, or :TRAILER after size 0
;;;;   :DATA           LEFT data octets, taken by the caller
;;;;   :DATA-CR, :DATA-LF   the CRLF after a chunk's data
;;;;   :TRAILER        the start of a trailer line: CR (the end) or a token octet
;;;;   :FIELD-NAME     token octets up to ":"
;;;;   :FIELD-VALUE    field value octets up to CR
;;;;   :FIELD-LF       its LF -> :TRAILER
;;;;   :LAST-LF        the LF of the final empty line -> NIL
;;;;   NIL             the body ended; nothing more is consumed.
;;;;
;;;; Invariants: LEFT > 0 exactly in :DATA; TOTAL is the sum of the sizes
;;;; announced so far and never exceeds MAX; LINE counts the octets of the
;;;; current size or trailer line, at most +MAX-CHUNK-LINE+; EXTRAS the
;;;; octets of extensions and trailer fields so far, at most
;;;; +MAX-CHUNK-EXTRAS+.

(in-package #:gallop.core)

(define-condition request-body-error (serious-condition)
  ((status :initarg :status :reader request-body-error-status))
  (:report (lambda (c s)
             (format s "~:[The chunked request body is malformed~;~
                        The request body is over the size limit~] (~D)."
                     (= 413 (request-body-error-status c)) (request-body-error-status c))))
  (:documentation "Signalled to the code reading a request body whose chunked
framing is wrong (STATUS 400) or which grows past the engine's MAX-BODY-BYTES
\(413).  Like HANDLER-TIMEOUT it is a SERIOUS-CONDITION, not an ERROR, so that a
handler that catches every ERROR cannot turn the client's bad body into an
ordinary answer: it reaches Gallop, which answers STATUS (unless a response
was already sent) and closes the connection."))

(defconstant +max-chunk-line+ 1024
  "The longest chunk size line (with its extensions) or trailer line.")

(defconstant +max-chunk-extras+ 65536
  "The most octets of chunk extensions and trailer fields one body may carry
in all: MAX-BODY-BYTES counts data only, and without this a client could
send extensions on every one-octet chunk, or trailer lines, for ever.")

(defstruct (chunk-decoder (:constructor make-chunk-decoder ()) (:copier nil))
  (state :size :type symbol)
  (left 0 :type fixnum)
  (total 0 :type fixnum)
  (line 0 :type fixnum)
  (extras 0 :type fixnum)
  (max 0 :type fixnum))

(defmethod print-object ((decoder chunk-decoder) stream)
  (print-unreadable-object (decoder stream :type t :identity t)))

(defun reset-chunk-decoder (d max)
  "Make D ready for a new chunked body of at most MAX data octets."
  (setf (chunk-decoder-state d) :size
        (chunk-decoder-left d) 0
        (chunk-decoder-total d) 0
        (chunk-decoder-line d) 0
        (chunk-decoder-extras d) 0
        (chunk-decoder-max d) max)
  d)

(declaim (inline chunk-decoder-take))
(defun chunk-decoder-take (d n)
  "The caller took N (at most LEFT) data octets of the current chunk."
  (declare (type fixnum n))
  (when (zerop (decf (chunk-decoder-left d) n))
    (setf (chunk-decoder-state d) :data-cr)))

(defun chunk-framing-error (status)
  (error 'request-body-error :status status))

(defun chunk-decoder-step (d buffer start end)
  "Consume framing octets of BUFFER[START,END) until the first data octet, the
end of the body or the end of the octets; return the index after the last one
consumed.  Signals REQUEST-BODY-ERROR."
  (declare (type octets buffer) (type fixnum start end) (optimize speed))
  (let ((state (chunk-decoder-state d))
        (line (chunk-decoder-line d)))
    (declare (type fixnum line))
    (macrolet ((bad () `(chunk-framing-error 400)))
      (flet ((ws-p (b) (or (= b +sp+) (= b +tab+))))
        (declare (inline ws-p))
        (loop while (and (< start end) state (not (eq state :data)))
              do (let ((b (aref buffer start)))
                   (declare (type (unsigned-byte 8) b))
                   (incf start)
                   (when (> (incf line) +max-chunk-line+)
                     (bad))
                   (when (and (member state '(:bws-semi :bws-name :ext-name :bws-equals
                                              :bws-value :ext-token :quoted :quoted-pair
                                              :after-quoted :field-name :field-value))
                              (> (incf (chunk-decoder-extras d)) +max-chunk-extras+))
                     (bad))
                   (setf state
                         (case state
                           (:size
                            (let ((digit (hex-value b)))
                              (unless digit (bad))
                              (setf (chunk-decoder-left d) digit)
                              :size-more))
                           (:size-more
                            (let ((digit (hex-value b)))
                              (cond (digit
                                     (let ((left (chunk-decoder-left d)))
                                       (when (> left (ash most-positive-fixnum -5)) (bad))
                                       (setf (chunk-decoder-left d) (+ (* 16 left) digit)))
                                     :size-more)
                                    ((ws-p b) :bws-semi)
                                    ((= b +semicolon+) :bws-name)
                                    ((= b +cr+) :size-lf)
                                    (t (bad)))))
                           (:bws-semi
                            (cond ((ws-p b) :bws-semi)
                                  ((= b +semicolon+) :bws-name)
                                  (t (bad))))
                           (:bws-name
                            (cond ((ws-p b) :bws-name)
                                  ((tchar-p b) :ext-name)
                                  (t (bad))))
                           (:ext-name
                            (cond ((tchar-p b) :ext-name)
                                  ((ws-p b) :bws-equals)
                                  ((= b +equals+) :bws-value)
                                  ((= b +semicolon+) :bws-name)
                                  ((= b +cr+) :size-lf)
                                  (t (bad))))
                           (:bws-equals
                            (cond ((ws-p b) :bws-equals)
                                  ((= b +equals+) :bws-value)
                                  ((= b +semicolon+) :bws-name)
                                  (t (bad))))
                           (:bws-value
                            (cond ((ws-p b) :bws-value)
                                  ((tchar-p b) :ext-token)
                                  ((= b +dquote+) :quoted)
                                  (t (bad))))
                           (:ext-token
                            (cond ((tchar-p b) :ext-token)
                                  ((ws-p b) :bws-semi)
                                  ((= b +semicolon+) :bws-name)
                                  ((= b +cr+) :size-lf)
                                  (t (bad))))
                           (:quoted
                            (cond ((= b +dquote+) :after-quoted)
                                  ((= b +backslash+) :quoted-pair)
                                  ((or (ws-p b) (<= 33 b 126) (>= b 128)) :quoted)
                                  (t (bad))))
                           (:quoted-pair
                            (if (or (ws-p b) (<= 33 b 126) (>= b 128)) :quoted (bad)))
                           (:after-quoted
                            (cond ((ws-p b) :bws-semi)
                                  ((= b +semicolon+) :bws-name)
                                  ((= b +cr+) :size-lf)
                                  (t (bad))))
                           (:size-lf
                            (unless (= b +lf+) (bad))
                            (setf line 0)
                            (let ((size (chunk-decoder-left d)))
                              (cond ((zerop size) :trailer)
                                    ((> (+ size (chunk-decoder-total d)) (chunk-decoder-max d))
                                     (chunk-framing-error 413))
                                    (t (incf (chunk-decoder-total d) size)
                                       :data))))
                           (:data-cr (if (= b +cr+) :data-lf (bad)))
                           (:data-lf (unless (= b +lf+) (bad)) (setf line 0) :size)
                           (:trailer
                            (cond ((= b +cr+) :last-lf)
                                  ((tchar-p b) :field-name)
                                  (t (bad))))
                           (:field-name
                            (cond ((tchar-p b) :field-name)
                                  ((= b +colon+) :field-value)
                                  (t (bad))))
                           (:field-value
                            (cond ((= b +cr+) :field-lf)
                                  ((vchar-p b) :field-value)
                                  (t (bad))))
                           (:field-lf (unless (= b +lf+) (bad)) (setf line 0) :trailer)
                           (:last-lf (unless (= b +lf+) (bad)) nil)
                           (t (error "CHUNK-DECODER-STEP: bad state ~S" state))))))))
    (setf (chunk-decoder-state d) state
          (chunk-decoder-line d) line)
    start))
