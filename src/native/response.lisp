;;;; response.lisp -- writing HTTP/1.1 responses straight into a connection's
;;;; output buffer: status lines encoded once, the Date line formatted at most
;;;; once a second, header names encoded once per keyword, and head and body
;;;; sent together by one send(2) when they fit the buffer.

(in-package #:gallop)

(deftype octets () '(simple-array (unsigned-byte 8) (*)))

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defun ascii (string)
    "STRING as octets; characters above 255 become ?."
    (let ((v (make-array (length string) :element-type '(unsigned-byte 8))))
      (dotimes (i (length string) v)
        (let ((code (char-code (char string i))))
          (setf (aref v i) (if (< code 256) code 63)))))))

(sb-int:defconstant-eqx +status-lines+
    (let ((lines (make-array 600 :initial-element nil)))
      (loop for code from 100 below 600
            do (setf (svref lines code)
                     (ascii (format nil "HTTP/1.1 ~D ~A~C~C" code
                                    (gallop.core:reason-phrase code)
                                    #\Return #\Linefeed))))
      lines)
  #'equalp
  "Status line octets for each code, encoded once.")

(sb-int:defconstant-eqx +content-length-prefix+
    (ascii (format nil "Content-Length: "))
  #'equalp)
(sb-int:defconstant-eqx +chunked-line+
    (ascii (format nil "Transfer-Encoding: chunked~C~C" #\Return #\Linefeed))
  #'equalp)
(sb-int:defconstant-eqx +connection-close-line+
    (ascii (format nil "Connection: close~C~C" #\Return #\Linefeed))
  #'equalp)
(sb-int:defconstant-eqx +keep-alive-line+
    (ascii (format nil "Connection: keep-alive~C~C" #\Return #\Linefeed))
  #'equalp)
(sb-int:defconstant-eqx +last-chunk+
    (ascii (format nil "0~C~C~C~C" #\Return #\Linefeed #\Return #\Linefeed))
  #'equalp)

(declaim (inline status-line))
(defun status-line (code)
  (let ((lines (load-time-value +status-lines+ t)))
    (declare (type simple-vector lines))
    (or (and (typep code 'fixnum) (< 99 code 600) (svref lines code))
        (svref lines 500))))

;;; Date, formatted at most once a second.  The cached pair is replaced, never
;;; mutated, so readers on other threads see a consistent one.

(sb-ext:define-load-time-global *date-line* (cons -1 nil)
  "(unix time . \"Date: ...\\r\\n\" octets)")

(defconstant +unix-epoch-universal-time+ 2208988800
  "1970-01-01T00:00:00Z as a universal time.")

(defun date-line ()
  (let ((now (gallop.core:unix-seconds))
        (cached *date-line*))
    (declare (type fixnum now))
    (if (eql now (car cached))
        (cdr cached)
        (multiple-value-bind (s m h day month year weekday)
            (decode-universal-time (+ now +unix-epoch-universal-time+) 0)
          (let ((line (ascii (format nil "Date: ~A, ~2,'0D ~A ~D ~2,'0D:~2,'0D:~2,'0D GMT~C~C"
                                     (svref #("Mon" "Tue" "Wed" "Thu" "Fri" "Sat" "Sun") weekday)
                                     day
                                     (svref #("Jan" "Feb" "Mar" "Apr" "May" "Jun" "Jul"
                                              "Aug" "Sep" "Oct" "Nov" "Dec") (1- month))
                                     year h m s #\Return #\Linefeed))))
            (setf *date-line* (cons now line))
            line)))))

;;; Header names

(sb-ext:define-load-time-global *header-name-octets* '()
  "((symbol . \"Name: \" octets) ...): every symbol WRITE-HEAD has seen, but
the common ones COMMON-HEADER-NAME-OCTETS knows.
Only ever replaced by a longer list, never mutated, so threads can read it
without a lock (two threads adding the same name at once only make a
duplicate entry).")

(defun header-name-line-start (name)
  "The octets \"Name: \" for the header NAME, a symbol (capitalized:
:CONTENT-TYPE gives Content-Type) or a string (as it is)."
  (ascii (concatenate 'string
                      (if (symbolp name) (string-capitalize (symbol-name name)) (string name))
                      ": ")))

(defmacro common-header-name-octets (name &rest keywords)
  "HEADER-NAME-LINE-START of NAME if it is one of KEYWORDS, else NIL: compared
with EQ against each, the octets constants in the code, so the response
headers most apps send touch no table."
  (let ((n (gensym "NAME")))
    `(let ((,n ,name))
       (cond ,@(loop for keyword in keywords
                     collect `((eq ,n ,keyword)
                               (load-time-value (header-name-line-start ,keyword) t)))))))

(defun header-name-octets (name)
  "\"Name: \" as octets for a header NAME (a keyword is capitalized:
:CONTENT-TYPE gives Content-Type), computed once per symbol."
  (if (symbolp name)
      (or (common-header-name-octets name :content-type :content-length :location :set-cookie
                                     :cache-control :last-modified :etag :expires :vary
                                     :content-encoding :content-disposition :server
                                     :access-control-allow-origin :x-content-type-options)
          (loop for entry in *header-name-octets*
                when (eq (car entry) name) return (cdr entry))
          (let ((octets (header-name-line-start name)))
            (setf *header-name-octets* (acons name octets *header-name-octets*))
            octets))
      (header-name-line-start name)))

(defun write-header-value (c value)
  "Write VALUE (a string, or anything PRINC can show) as latin-1; CR and LF
become spaces, so a value can't inject a header."
  (gallop.core:connection-write-latin1 c (if (stringp value) value (princ-to-string value))))

;;; Bodies

(defun simple-ascii-string-p (object)
  "True if OBJECT is a simple string of ASCII characters only (its UTF-8
encoding is its character codes)."
  (macrolet ((ascii-p (type)
               `(let ((string object))
                  (declare (type ,type string) (optimize speed))
                  (dotimes (i (length string) t)
                    (unless (< (char-code (schar string i)) 128)
                      (return nil))))))
    (typecase object
      ((simple-array character (*)) (ascii-p (simple-array character (*))))
      (simple-base-string (ascii-p simple-base-string)))))

(defun body-octets (chunk)
  "A body chunk (string or octet vector) as octets; strings in UTF-8."
  (etypecase chunk
    (octets chunk)
    (string (sb-ext:string-to-octets chunk :external-format :utf-8))
    ((vector (unsigned-byte 8)) (coerce chunk 'octets))
    (null (make-array 0 :element-type '(unsigned-byte 8)))))

(defun header-value (headers name)
  "The value of header NAME (a keyword) in the property list HEADERS, whose
keys are keywords or strings."
  (declare (type symbol name))
  (loop for (key value) on headers by #'cddr
        when (or (eq key name) (and (not (keywordp key)) (string-equal key name)))
          return value))

(declaim (inline no-body-status-p))
(defun no-body-status-p (status)
  (or (< status 200) (= status 204) (= status 304)))

;;; The head, and a short ASCII body, written straight into the output
;;; buffer: one size computation, then copies with the fill index in a
;;; register.  Heads that do not fit, or whose header values are not all
;;; strings, take the general path below it.

(declaim (inline put-octets))
(defun put-octets (buffer fill octets)
  "Copy OCTETS into BUFFER at FILL; the index after them."
  (declare (type octets buffer octets) (type fixnum fill) (optimize speed (safety 0)))
  (let ((n (length octets)))
    (if (< n 24)
        (dotimes (i n) (setf (aref buffer (+ fill i)) (aref octets i)))
        (replace buffer octets :start1 fill))
    (+ fill n)))

;;; Not GALLOP.CORE:PUT-LATIN1: that copies header values, turning CR and LF
;;; into spaces so that a value cannot inject a header.  A body is sent as
;;; it is, every octet.
(defun put-ascii (buffer fill string)
  "Copy STRING, a simple string of ASCII characters only (see
SIMPLE-ASCII-STRING-P), into BUFFER at FILL unchanged: each character as
its code, CR, LF and NUL included.  The index after it; BUFFER must have
room."
  (declare (type octets buffer) (type fixnum fill) (type simple-string string))
  ;; One loop per string representation, reading characters directly.
  (macrolet ((copy (type)
               `(let ((string string))
                  (declare (type ,type string) (optimize speed (safety 0)))
                  (dotimes (i (length string))
                    ;; LOGAND: an octet whatever the caller passed (the codes
                    ;; are below 128, so it changes nothing).
                    (setf (aref buffer (+ fill i)) (logand #xff (char-code (schar string i))))))))
    (if (typep string '(simple-array character (*)))
        (copy (simple-array character (*)))
        (copy simple-base-string)))
  (the fixnum (+ fill (length string))))

(defun fast-head-size (status-line date-line headers content-length chunked keep-alive http-1.0)
  "The size of the head WRITE-HEAD would write, or NIL if it needs the
general path (a header value that is not a string, a huge length)."
  (declare (type octets status-line date-line))
  (let ((size (+ (length status-line) (length date-line) 2))
        (has-length nil))
    (declare (type fixnum size))
    (loop for (name value) on headers by #'cddr
          when value
            do (unless (and (stringp value) (or (symbolp name) (stringp name)))
                 (return-from fast-head-size nil))
               (when (if (symbolp name) (eq name :content-length) (string-equal name :content-length))
                 (setf has-length t))
               (incf size (+ (length (the octets (header-name-octets name)))
                             (length (the string value)) 2)))
    (when (and content-length (not has-length))
      (unless (typep content-length '(and fixnum unsigned-byte))
        (return-from fast-head-size nil))
      (incf size (+ (length (the octets (load-time-value +content-length-prefix+ t))) 20 2)))
    (when chunked
      (incf size (length (the octets (load-time-value +chunked-line+ t)))))
    (cond ((not keep-alive) (incf size (length (the octets (load-time-value +connection-close-line+ t)))))
          (http-1.0 (incf size (length (the octets (load-time-value +keep-alive-line+ t))))))
    (values size has-length)))

(defun write-head (c status headers &key content-length chunked keep-alive http-1.0 ascii-body)
  "Write the status line and headers.  Adds Date, Content-Length (when known
and the app did not give one), Transfer-Encoding and Connection.  Then
ASCII-BODY, a simple string of ASCII characters, if given, unchanged (CR and
LF too: only header values are neutralised)."
  (%write-head c status headers content-length chunked keep-alive http-1.0 ascii-body))

(defun %write-head (c status headers content-length chunked keep-alive http-1.0 ascii-body)
  "WRITE-HEAD with positional arguments, for RESPOND: once per request, where
parsing keyword arguments cost more than some of the writing.  Every answer
of the native layer begins here, so it is counted here for the metrics."
  (gallop.core:connection-count-answer c status)
  (let ((status-line (status-line status))
        (date-line (date-line)))
    (multiple-value-bind (size has-length)
        (fast-head-size status-line date-line headers content-length chunked keep-alive http-1.0)
      (multiple-value-bind (buffer fill)
          (and size (gallop.core:connection-reserve-output
                     c (+ size (if ascii-body (length (the simple-string ascii-body)) 0))))
        (cond
          (buffer
           (let ((crlf (load-time-value gallop.core:+crlf-octets+ t)))
             (declare (type octets buffer crlf) (type fixnum fill))
             (setf fill (put-octets buffer fill status-line)
                   fill (put-octets buffer fill date-line))
             (loop for (name value) on headers by #'cddr
                   when value
                     do (setf fill (put-octets buffer fill (header-name-octets name))
                              fill (gallop.core:put-latin1 buffer fill value)
                              fill (put-octets buffer fill crlf)))
             (when (and content-length (not has-length))
               (setf fill (put-octets buffer fill (load-time-value +content-length-prefix+ t))
                     fill (gallop.core:put-decimal buffer fill content-length)
                     fill (put-octets buffer fill crlf)))
             (when chunked
               (setf fill (put-octets buffer fill (load-time-value +chunked-line+ t))))
             (cond ((not keep-alive)
                    (setf fill (put-octets buffer fill (load-time-value +connection-close-line+ t))))
                   (http-1.0
                    (setf fill (put-octets buffer fill (load-time-value +keep-alive-line+ t)))))
             (setf fill (put-octets buffer fill crlf))
             (when ascii-body
               (setf fill (put-ascii buffer fill ascii-body)))
             (gallop.core:connection-commit-output c fill)))
          (t
           (write-head-in-parts c status-line date-line headers content-length chunked
                                keep-alive http-1.0)
           (when ascii-body
             (gallop.core:connection-write-ascii c ascii-body))))))))

(defun write-head-in-parts (c status-line date-line headers content-length chunked keep-alive http-1.0)
  "WRITE-HEAD's general path: any header values, any head size."
  (gallop.core:connection-write-octets c status-line)
  (gallop.core:connection-write-octets c date-line)
  (let ((has-length nil))
    (loop for (name value) on headers by #'cddr
          when value
            do (when (if (symbolp name)
                         (eq name :content-length)
                         (string-equal name :content-length))
                 (setf has-length t))
               (gallop.core:connection-write-octets c (header-name-octets name))
               (write-header-value c value)
               (gallop.core:connection-write-octets c gallop.core:+crlf-octets+))
    (when (and content-length (not has-length))
      (gallop.core:connection-write-octets c +content-length-prefix+)
      (gallop.core:connection-write-decimal c content-length)
      (gallop.core:connection-write-octets c gallop.core:+crlf-octets+)))
  (when chunked
    (gallop.core:connection-write-octets c +chunked-line+))
  (cond ((not keep-alive) (gallop.core:connection-write-octets c +connection-close-line+))
        (http-1.0 (gallop.core:connection-write-octets c +keep-alive-line+)))
  (gallop.core:connection-write-octets c gallop.core:+crlf-octets+))

(defun write-chunk (c octets)
  "One chunk of a chunked body."
  (when (plusp (length octets))
    (gallop.core:connection-write-octets c (ascii (format nil "~X~C~C" (length octets)
                                                          #\Return #\Linefeed)))
    (gallop.core:connection-write-octets c octets)
    (gallop.core:connection-write-octets c gallop.core:+crlf-octets+)))
